"""WordNet synonym substitution (NLTK). POS-aware without a tagger: a word's part of speech is that of
its most frequent WordNet sense, and only synonyms of that part of speech are used. Frequent lemmas
only: synonyms from the word's most frequent sense that SemCor saw it in, and only those SemCor uses
more often than the word itself, most used first. Multi-word lemmas become phrases ("hot_dog" -> "hot dog")."""

from __future__ import annotations

import threading
from functools import lru_cache

from paraseek.paraphrase import ParaphraseSourceUnavailable, substitution_variants


def _wordnet():
    try:
        from nltk.corpus import wordnet

        wordnet.ensure_loaded()
    except (LookupError, ImportError, OSError) as exc:
        raise ParaphraseSourceUnavailable(
            "WordNet is not installed for NLTK (set NLTK_DATA to a folder with corpora/wordnet.zip)"
        ) from exc
    return wordnet


def general_sentences() -> list[str]:
    """WordNet's usage examples and glosses (about 165K, deduplicated, in WordNet's order): general-domain
    English, for training terms that keep a text tower's behaviour outside the domain it is tuned on."""
    return list(_general_sentences())


@lru_cache(maxsize=1)
def _general_sentences() -> tuple[str, ...]:
    # read once a process: walking NLTK's 117K synsets takes about 20 s on 2 cores, and a sweep (or a test
    # session) builds one trainer after another; a failed read is not cached
    wn = _wordnet()
    texts = (text for synset in wn.all_synsets() for text in (*synset.examples(), synset.definition()))
    return tuple(dict.fromkeys(t.strip() for t in texts if t.strip()))


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
