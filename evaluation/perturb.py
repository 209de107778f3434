"""Text perturbations in the style of COCO-TP, seeded: character level (keyboard typos, OCR
confusions, insert, replace, swap, delete) and word level (WordNet synonym, insertion, swap,
deletion, punctuation). Each perturbs about ``rate`` of the eligible characters or words (at least one)."""

from __future__ import annotations

import random
import string
from typing import Callable

from paraseek.paraphrase import STOPWORDS, match_case

KEYBOARD = {
    "q": "wa", "w": "qes", "e": "wrd", "r": "etf", "t": "ryg", "y": "tuh", "u": "yij", "i": "uok", "o": "ipl", "p": "ol",
    "a": "qsz", "s": "awdz", "d": "sefx", "f": "drgc", "g": "fthv", "h": "gyjb", "j": "hukn", "k": "jilm", "l": "kop",
    "z": "asx", "x": "zsdc", "c": "xdfv", "v": "cfgb", "b": "vghn", "n": "bhjm", "m": "njk",
}
OCR = {"o": "0", "l": "1", "i": "1", "e": "c", "a": "o", "s": "5", "b": "6", "g": "9", "t": "f", "m": "rn", "rn": "m",
       "cl": "d", "d": "cl", "h": "b", "u": "v", "n": "ri", "z": "2"}
FILLERS = ["really", "very", "quite", "just", "also", "some", "that", "there"]


def _positions(text: str, rng: random.Random, rate: float, pred=str.isalpha) -> list[int]:
    idx = [i for i, c in enumerate(text) if pred(c)]
    if not idx:
        return []
    return sorted(rng.sample(idx, max(1, round(rate * len(idx)))))


def _edit_chars(text: str, rng: random.Random, rate: float, edit: Callable[[str, random.Random], str]) -> str:
    chars = list(text)
    for i in reversed(_positions(text, rng, rate)):
        chars[i] = edit(chars[i], rng)
    return "".join(chars)


def keyboard(text, rng, rate=0.05):
    return _edit_chars(text, rng, rate, lambda c, r: match_case(r.choice(KEYBOARD.get(c.lower(), c)), c))


def ocr(text, rng, rate=0.05):
    return _edit_chars(text, rng, rate, lambda c, r: OCR.get(c.lower(), c))


def char_insert(text, rng, rate=0.05):
    return _edit_chars(text, rng, rate, lambda c, r: c + r.choice(string.ascii_lowercase))


def char_replace(text, rng, rate=0.05):
    return _edit_chars(text, rng, rate, lambda c, r: r.choice(string.ascii_lowercase))


def char_delete(text, rng, rate=0.05):
    return _edit_chars(text, rng, rate, lambda c, r: "")


def char_swap(text, rng, rate=0.05):
    chars = list(text)
    for i in _positions(text[:-1], rng, rate):
        if chars[i + 1].isalpha():
            chars[i], chars[i + 1] = chars[i + 1], chars[i]
    return "".join(chars)


def _words(text):
    return text.split()


def word_delete(text, rng, rate=0.1):
    words = _words(text)
    if len(words) < 2:
        return text
    drop = set(rng.sample(range(len(words)), max(1, min(len(words) - 1, round(rate * len(words))))))
    return " ".join(w for i, w in enumerate(words) if i not in drop)


def word_insert(text, rng, rate=0.1):
    words = _words(text)
    for _ in range(max(1, round(rate * len(words)))):
        words.insert(rng.randrange(len(words) + 1), rng.choice(FILLERS))
    return " ".join(words)


def word_swap(text, rng, rate=0.1):
    words = _words(text)
    if len(words) < 2:
        return text
    for _ in range(max(1, round(rate * len(words)))):
        i = rng.randrange(len(words) - 1)
        words[i], words[i + 1] = words[i + 1], words[i]
    return " ".join(words)


def punctuation(text, rng, rate=0.1):
    words = _words(text)
    for _ in range(max(1, round(rate * len(words)))):
        i = rng.randrange(len(words))
        words[i] = words[i] + rng.choice([",", ".", "!", "?", ";", ":"])
    return " ".join(words)


def make_synonym(wordnet_source) -> Callable:
    def synonym(text, rng, rate=0.1):
        words = _words(text)
        eligible = [i for i, w in enumerate(words) if w.isalpha() and w.lower() not in STOPWORDS
                    and wordnet_source.synonyms(w)]
        if not eligible:
            return text
        for i in rng.sample(eligible, max(1, min(len(eligible), round(rate * len(words))))):
            words[i] = match_case(rng.choice(wordnet_source.synonyms(words[i])), words[i])
        return " ".join(words)

    return synonym


CHARACTER = {"keyboard": keyboard, "ocr": ocr, "char_insert": char_insert, "char_replace": char_replace,
             "char_swap": char_swap, "char_delete": char_delete}
WORD = {"word_insert": word_insert, "word_swap": word_swap, "word_delete": word_delete, "punctuation": punctuation}


def perturbations(wordnet_source=None) -> dict[str, Callable]:
    out = dict(CHARACTER)
    if wordnet_source is not None:
        out["synonym"] = make_synonym(wordnet_source)
    out.update(WORD)
    return out


def perturb_all(texts, fn, seed: int = 0) -> list[str]:
    """Apply ``fn`` to every text with its own seeded generator (same seed, same output)."""
    out = []
    for i, t in enumerate(texts):
        p = fn(t, random.Random(f"{seed}:{i}"))
        out.append(p if p.strip() else t)
    return out
