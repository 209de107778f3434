"""PPDB lexical paraphrase pairs from a TSV file (word <TAB> paraphrase), most reliable first.
PPDB is noisy: inflections of the same word (dog/dogs) and non-words are dropped at load, and only
rewrites toward more usual caption wording are offered."""

from __future__ import annotations

import os
from pathlib import Path

from paraseek.paraphrase import ParaphraseSourceUnavailable, substitution_variants
from paraseek.paraphrase.caption_bank import caption_word_counts


def _usage(phrase: str, counts) -> int:
    """How often captions use a (multi-word) phrase's rarest word."""
    return min(counts[w] for w in phrase.lower().split())


def _is_variant(a: str, b: str) -> bool:
    return a.startswith(b) or b.startswith(a) or a[:4] == b[:4] and abs(len(a) - len(b)) <= 2


class PPDBSource:
    name = "ppdb"

    def __init__(self, path: str | os.PathLike | None, max_per_word: int = 8, usual_only: bool = True):
        # PPDB is noisy and unranked by usage: only rewrites toward the wording captions use more often
        # (by the shipped captions' word counts) make two rephrasings meet instead of drift apart
        self.usual_only = usual_only
        if not path:
            raise ParaphraseSourceUnavailable("no PPDB file configured (PARASEEK_PPDB_PATH)")
        path = Path(path)
        if not path.is_file():
            raise ParaphraseSourceUnavailable(f"PPDB file {path} does not exist")
        table: dict[str, list[str]] = {}
        with open(path, encoding="utf-8", errors="replace") as f:
            for line in f:
                parts = line.rstrip("\n").split("\t")
                if len(parts) < 2:
                    continue
                a, b = parts[0].strip().lower(), parts[1].strip()
                if not (a.isalpha() and b.replace(" ", "").replace("-", "").isalpha()) or _is_variant(a, b.lower()):
                    continue
                alts = table.setdefault(a, [])
                if len(alts) < max_per_word and b not in alts:
                    alts.append(b)
        self._table = table

    def synonyms(self, word: str) -> list[str]:
        word = word.lower()
        alternatives = self._table.get(word, [])
        if self.usual_only:
            counts = caption_word_counts()
            alternatives = [a for a in alternatives if _usage(a, counts) > counts[word]]
        return alternatives

    def paraphrases(self, text: str, n: int) -> list[str]:
        return substitution_variants(text, self.synonyms, n)
