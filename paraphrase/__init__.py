"""Paraphrase and query-expansion sources, shared by the service (expansion, consistency reports)
and training (ParaCLIP's two-step generation, LaCLIP rewrites).

wordnet: synonym substitution with NLTK WordNet; ppdb: lexical pairs from a PPDB file; llm: any
OpenAI-compatible chat endpoint (one step); generator: ParaCLIP's two-step generation through that
endpoint (caption -> x', then x' -> x'' avoiding the words already used).
"""

from __future__ import annotations

import re
from typing import Protocol

from paraseek.core.errors import UserError

_WORD = re.compile(r"[A-Za-z]+(?:'[a-z]+)?|[^A-Za-z\s]+|\s+")


class ParaphraseSourceUnavailable(UserError):
    """The source is not configured or its data is missing (the API answers 400, not 500)."""


class ParaphraseSource(Protocol):
    name: str

    def paraphrases(self, text: str, n: int) -> list[str]:
        """Up to n distinct rephrasings of ``text`` (never ``text`` itself)."""
        ...


def split_words(text: str) -> list[str]:
    """Words, punctuation and whitespace as separate pieces; ''.join(pieces) == text."""
    return _WORD.findall(text)


def match_case(replacement: str, original: str) -> str:
    if original[:1].isupper():
        return replacement[:1].upper() + replacement[1:]
    return replacement


# Function words and prepositions never substituted (a small fixed list: NLTK's stopwords corpus is not always
# installed; without a tagger, WordNet would read "behind" as a noun)
STOPWORDS = frozenset(
    """a an the and or but if then else of at by for with about against between into through during
    before after above below to from up down in out on off over under again further once here there
    when where why how all any both each few more most other some such no nor not only own same so
    than too very can will just don should now is are was were be been being have has had having do
    does did doing i me my myself we our ours you your he him his she her it its they them their
    what which who whom this that these those am as until while s t behind near along inside outside
    beside next across around toward towards onto upon among within without beneath underneath""".split()
)


def substitution_variants(text: str, alternatives, n: int) -> list[str]:
    """Up to n variants of ``text``: variant i replaces each substitutable word by its
    (i mod len)-th alternative, so variants differ from each other and change every word they can.

    ``alternatives(word) -> list[str]`` returns replacements for a lower-cased word.
    """
    pieces = split_words(text)
    options = []
    for p in pieces:
        low = p.lower()
        if p.strip() and p[0].isalpha() and low not in STOPWORDS:
            alts = [a for a in alternatives(low) if a.lower() != low]
            options.append(alts)
        else:
            options.append([])
    if not any(options):
        return []
    out: list[str] = []
    seen = {text.lower()}
    longest = max(len(o) for o in options)
    for i in range(longest):
        variant = "".join(
            match_case(opts[i % len(opts)], p) if opts else p for p, opts in zip(pieces, options)
        )
        if variant.lower() not in seen:
            seen.add(variant.lower())
            out.append(variant)
        if len(out) == n:
            break
    # fewer full variants than asked: add single-word substitutions
    for idx, opts in enumerate(options):
        for alt in opts:
            if len(out) >= n:
                return out
            variant = "".join(match_case(alt, p) if j == idx else p for j, p in enumerate(pieces))
            if variant.lower() not in seen:
                seen.add(variant.lower())
                out.append(variant)
    return out[:n]
