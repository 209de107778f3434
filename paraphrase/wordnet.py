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


# Debian's wordnet-base (install.sh installs it): WordNet 3.0's database files, the ones NLTK's zip holds
DEBIAN_WORDNET = Path("/usr/share/wordnet")
INSTALL_HINT = ("sudo apt-get install wordnet-base" if Path("/etc/debian_version").exists()
                else "python -m nltk.downloader wordnet")
# lexnames, the one database file NLTK reads that Debian's package leaves out (its content is in the
# lexnames(5WN) manual page): the 45 lexicographer files of WordNet 3.0, in number order, with the
# part of speech each holds (1 noun, 2 verb, 3 adjective, 4 adverb)
LEXNAMES = tuple(zip(
    "adj.all adj.pert adv.all noun.Tops noun.act noun.animal noun.artifact noun.attribute noun.body noun.cognition "
    "noun.communication noun.event noun.feeling noun.food noun.group noun.location noun.motive noun.object "
    "noun.person noun.phenomenon noun.plant noun.possession noun.process noun.quantity noun.relation noun.shape "
    "noun.state noun.substance noun.time verb.body verb.change verb.cognition verb.communication verb.competition "
    "verb.consumption verb.contact verb.creation verb.emotion verb.motion verb.perception verb.possession "
    "verb.social verb.stative verb.weather adj.ppl".split(),
    "334111111111111111111111111112222222222222223", strict=True))


def lexnames_file() -> str:
    return "".join(f"{number:02d}\t{name}\t{pos}\n" for number, (name, pos) in enumerate(LEXNAMES))


def _wordnet():
    """WordNet from NLTK's data where NLTK finds it (NLTK_DATA, ~/nltk_data: what a user put there),
    else Debian's database files read in place. One reader a process for each."""
    root = _wordnet_root()
    if root is None:
        raise ParaphraseSourceUnavailable(f"WordNet is not installed: {INSTALL_HINT}")
    return _english_wordnet(root)


def _wordnet_root() -> str | None:
    """Where the WordNet files are, found as NLTK's loader finds them (the zip first), else Debian's
    folder; None: nowhere."""
    try:
        import nltk.data
    except ImportError as exc:
        raise ParaphraseSourceUnavailable("NLTK is not installed: pip install 'paraseek[serve]'") from exc
    for name in ("corpora/wordnet.zip/wordnet/", "corpora/wordnet/"):
        try:
            found = nltk.data.find(name)
        except LookupError:
            continue
        # "<...>/wordnet.zip/wordnet/" or a folder: the reader takes both as text
        return f"{found.zipfile.filename}/{found.entry}" if hasattr(found, "zipfile") else found.path
    return str(DEBIAN_WORDNET) if (DEBIAN_WORDNET / "data.noun").is_file() else None


@lru_cache(maxsize=4)
def _english_wordnet(root: str):
    import io
    import warnings

    import nltk.data
    from nltk.corpus.reader.wordnet import WordNetCorpusReader

    class EnglishWordNet(WordNetCorpusReader):
        """NLTK's reader over any WordNet 3.0 database folder: without the multilingual (OMW) tables,
        whose sense-key map NLTK builds at every load (about 3 s) and the English synonyms never use,
        and with lexnames supplied where a folder lacks it (Debian's)."""

        def open(self, file):
            try:
                return super().open(file)
            except OSError:
                if file != "lexnames":
                    raise
                return io.StringIO(lexnames_file())

        def map_wn(self, version="wordnet"):
            return None

    if ".zip" not in root and root not in nltk.data.path:  # NLTK reads corpora only under its data path
        nltk.data.path.append(root)
    try:
        with warnings.catch_warnings():  # "multilingual functions are not available": English only
            warnings.simplefilter("ignore", UserWarning)
            return EnglishWordNet(root, None)
    except (OSError, ValueError, AssertionError, LookupError) as exc:
        raise ParaphraseSourceUnavailable(f"WordNet in {root} is unreadable ({exc}): {INSTALL_HINT}") from exc


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
    import nltk

    root = _wordnet_root()
    if root is None:
        raise ParaphraseSourceUnavailable(f"WordNet is not installed: {INSTALL_HINT}")
    if ".zip" in root:
        files = [root[:root.index(".zip") + 4]]
    else:
        files = [os.path.join(root, f"data.{pos}") for pos in ("noun", "verb", "adj", "adv")]
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
