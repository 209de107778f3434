"""WordNet synonym substitution (NLTK). POS-aware without a tagger: a word's part of speech is that of
its most frequent WordNet sense, and only synonyms of that part of speech are used. Frequent lemmas
only: synonyms from the word's most frequent sense that SemCor saw it in, and only those SemCor uses
more often than the word itself, most used first. Multi-word lemmas become phrases ("hot_dog" -> "hot dog")."""

from __future__ import annotations

import contextlib
import gzip
import hashlib
import json
import logging
import os
import threading
import zlib
from functools import lru_cache
from pathlib import Path

from paraseek.paraphrase import ParaphraseSourceUnavailable, substitution_variants

log = logging.getLogger(__name__)


def _wordnet():
    try:
        from nltk.corpus import wordnet

        wordnet.ensure_loaded()
    except (LookupError, ImportError, OSError) as exc:
        raise ParaphraseSourceUnavailable(
            "WordNet is not installed for NLTK (set NLTK_DATA to a folder with corpora/wordnet.zip)"
        ) from exc
    return wordnet


def general_sentences(cache_dir: Path | None = None) -> list[str]:
    """WordNet's usage examples and glosses (about 165K, deduplicated, in WordNet's order): general-domain
    English, for training terms that keep a text tower's behaviour outside the domain it is tuned on.
    Kept in ``cache_dir`` (default: PARASEEK_HOME/cache) for the next process."""
    if cache_dir is None:
        from paraseek.core.settings import Settings

        cache_dir = Settings().home / "cache"
    return list(_general_sentences(cache_dir))


@lru_cache(maxsize=2)
def _general_sentences(cache_dir: Path) -> tuple[str, ...]:
    # walking NLTK's 117K synsets takes about 20 s on 2 cores, and every training run with the WordNet
    # sentences held started with it: read once a process, and from a file that the corpus's own stamps
    # name (another WordNet, or another NLTK that reads it, walks again); a failed read is not cached
    cache = cache_dir / f"wordnet-sentences-{_corpus_key()}.json.gz"
    try:
        with gzip.open(cache, "rt", encoding="utf-8") as f:
            return tuple(json.load(f))
    except FileNotFoundError:
        pass
    except (OSError, EOFError, zlib.error, ValueError) as exc:  # a torn or foreign file: walked and written again
        log.warning("WordNet sentences cache %s unreadable (%s): reading WordNet", cache, exc)
    wn = _wordnet()
    texts = (text for synset in wn.all_synsets() for text in (*synset.examples(), synset.definition()))
    sentences = tuple(dict.fromkeys(t.strip() for t in texts if t.strip()))
    part = cache.with_name(f"{cache.name}.{os.getpid()}.part")  # whole or absent: another process may read it
    try:
        cache_dir.mkdir(parents=True, exist_ok=True)
        with gzip.open(part, "wt", encoding="utf-8") as f:
            json.dump(sentences, f)
        os.replace(part, cache)
    except OSError as exc:  # a read-only or full home: the next process walks again
        log.warning("WordNet sentences not cached in %s: %s", cache_dir, exc)
        with contextlib.suppress(OSError):  # none written, or no folder to write it in
            part.unlink()
    return sentences


def _corpus_key() -> str:
    """A short digest of the WordNet files NLTK reads (path, size, modification time) and NLTK's version,
    found as NLTK's loader finds them, without loading WordNet (3 s here)."""
    try:
        import nltk
        import nltk.data
    except ImportError:
        _wordnet()  # raises: NLTK is not installed
        raise
    for name in ("corpora/wordnet.zip/wordnet/", "corpora/wordnet/"):  # the loader's order: the zip first
        try:
            root = nltk.data.find(name)
            break
        except LookupError:
            continue
    else:
        root = _wordnet().root  # raises: WordNet is not installed
    files = [root.zipfile.filename] if hasattr(root, "zipfile") else [
        os.path.join(root.path, f"data.{pos}") for pos in ("noun", "verb", "adj", "adv")]
    h = hashlib.blake2b(nltk.__version__.encode(), digest_size=8)
    for name in files:
        try:
            st = os.stat(name)
            h.update(f"{os.path.abspath(name)} {st.st_size} {st.st_mtime_ns}".encode())
        except OSError:  # NLTK reports a broken corpus when it reads it
            h.update(f"{os.path.abspath(name)} missing".encode())
    return h.hexdigest()


def _pos(synset) -> str:
    return {"s": "a"}.get(synset.pos(), synset.pos())  # satellite adjectives are adjectives


class WordNetSource:
    name = "wordnet"

    def __init__(self, max_per_word: int = 4, senses: int = 1, min_ratio: float = 1.0):
        self.max_per_word = max_per_word
        self.senses = senses  # how many of the word's most frequent senses give synonyms
        self.min_ratio = min_ratio  # a synonym must be used this many times as often as the word (SemCor; < 0: any)
        self._wn = _wordnet()
        # NLTK's WordNet reader shares one zip-file handle: concurrent reads from threads corrupt it
        # (AssertionError in nltk.data), so lookups are serialised; they are memoised, so rarely waited on
        self._lock = threading.Lock()
        self._synonyms = lru_cache(maxsize=50_000)(self._lookup)

    def _lookup(self, word: str) -> list[str]:
        with self._lock:
            return self._lookup_unlocked(word)

    def _lookup_unlocked(self, word: str) -> list[str]:
        synsets = self._wn.synsets(word)
        if not synsets:
            return []
        pos = _pos(synsets[0])
        base = self._wn.morphy(word) or word  # "walking" -> "walk": not a rephrasing, just uninflected
        own_names = {word, base}
        counts: dict[str, int] = {}
        # the senses SemCor saw this word in, most frequent first (WordNet's order); synonyms of rarer
        # senses mean something else ("picture" -> "movie")
        seen = 0
        for syn in synsets:
            own = max((lemma.count() for lemma in syn.lemmas() if lemma.name().lower() in own_names), default=0)
            if _pos(syn) != pos or own < 1:
                continue
            for lemma in syn.lemmas():
                name = lemma.name().replace("_", " ")
                # only the more usual wording of the same sense ("kid" -> "child", "automobile" -> "car"): two
                # rephrasings then tend to meet on the same words instead of drifting apart
                if name.lower() not in own_names and lemma.count() > own * self.min_ratio:
                    counts[name] = max(counts.get(name, 0), lemma.count())
            seen += 1
            if seen == self.senses:
                break
        return sorted(counts, key=lambda name: -counts[name])[: self.max_per_word]

    def synonyms(self, word: str) -> list[str]:
        return self._synonyms(word.lower())

    def paraphrases(self, text: str, n: int) -> list[str]:
        return substitution_variants(text, self.synonyms, n)
