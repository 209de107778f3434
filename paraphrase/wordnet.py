"""WordNet synonym substitution (NLTK). POS-aware without a tagger: a word's part of speech is that of
its most frequent WordNet sense, and only synonyms of that part of speech are used; multi-word lemmas
become phrases ("hot_dog" -> "hot dog")."""

from __future__ import annotations

import threading
from functools import lru_cache

from paraphrase import ParaphraseSourceUnavailable, substitution_variants


class WordNetSource:
    name = "wordnet"

    def __init__(self, max_per_word: int = 4):
        self.max_per_word = max_per_word
        try:
            from nltk.corpus import wordnet

            wordnet.ensure_loaded()
        except (LookupError, ImportError, OSError) as exc:
            raise ParaphraseSourceUnavailable(
                "WordNet is not installed for NLTK (set NLTK_DATA to a folder with corpora/wordnet.zip)"
            ) from exc
        self._wn = wordnet
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
        pos = synsets[0].pos()
        pos = {"s": "a"}.get(pos, pos)
        base = self._wn.morphy(word) or word  # "walking" -> "walk": not a rephrasing, just uninflected
        out: list[str] = []
        for syn in synsets:
            if {"s": "a"}.get(syn.pos(), syn.pos()) != pos:
                continue
            for lemma in syn.lemmas():
                name = lemma.name().replace("_", " ")
                if name.lower() not in (word, base) and name not in out:
                    out.append(name)
            if len(out) >= self.max_per_word:
                break
        return out[: self.max_per_word]

    def synonyms(self, word: str) -> list[str]:
        return self._synonyms(word.lower())

    def paraphrases(self, text: str, n: int) -> list[str]:
        return substitution_variants(text, self.synonyms, n)
