"""Tokenizer setup, the one place that loads a ``tokenizer.json``: the runtime's ``BundleTokenizer``
(pads each batch to its longest sequence, truncates to the context, reports truncation) and the
training side (``load_tokenizer``) share it, so ids are the same at training, export and serving.
"""

from __future__ import annotations

import hashlib
import html
import logging
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np

from paraseek.core.errors import UserError

log = logging.getLogger(__name__)


class EmptyTextError(UserError):
    """A text is empty or whitespace only: there is nothing to encode."""


def load_tokenizer(tokenizer_file: str | Path, max_tokens: int, pad_id: int | None = None):
    """A ``tokenizers.Tokenizer`` truncating to ``max_tokens``; padded to the batch's longest
    sequence when ``pad_id`` is given (training), else unpadded (the runtime pads itself)."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tokenizer_file))
    if pad_id is None:
        tok.no_padding()
    else:
        tok.enable_padding(pad_id=pad_id)
    tok.enable_truncation(max_length=max_tokens)
    return tok


_WHITESPACE = re.compile(r"\s+")


def clip_clean(text: str) -> str:
    """open_clip's text cleaning (basic_clean + whitespace_clean), lowercased."""
    import ftfy

    text = ftfy.fix_text(text)
    text = html.unescape(html.unescape(text))
    return _WHITESPACE.sub(" ", text).strip().lower()


@dataclass
class TokenBatch:
    input_ids: np.ndarray  # (B, L) int64, L = longest real sequence in the batch
    attention_mask: np.ndarray  # (B, L) int64
    truncated: list[bool]  # per text: tokens beyond max_tokens were dropped


class BundleTokenizer:
    """Tokeniser of a bundle: pads each batch only to its longest sequence, truncates to max_tokens."""

    def __init__(self, tokenizer_file: Path, max_tokens: int, cleaning: str, pad_id: int):
        self._tok = load_tokenizer(tokenizer_file, max_tokens)
        self.max_tokens = max_tokens
        self.cleaning = cleaning
        self.pad_id = pad_id

    def _prepare(self, text: str, position: int) -> str:
        if not isinstance(text, str):
            raise TypeError(f"text #{position} is {type(text).__name__}, expected str")
        if not text.strip():
            raise EmptyTextError(f"text #{position} is empty or whitespace only")
        if self.cleaning == "clip":
            text = clip_clean(text)
            if not text:
                raise EmptyTextError(f"text #{position} is empty after cleaning")
        return text

    def __call__(self, texts: Sequence[str]) -> TokenBatch:
        return self.pad(self.encode(texts))

    def encode(self, texts: Sequence[str]) -> list:
        """Each text's ``tokenizers.Encoding``, unpadded, truncated to max_tokens (``pad`` batches them)."""
        return self._tok.encode_batch([self._prepare(t, i) for i, t in enumerate(texts)])

    def pad(self, encodings: Sequence) -> TokenBatch:
        """Encodings as one batch, padded to its longest sequence."""
        length = max(len(e.ids) for e in encodings)
        ids = np.full((len(encodings), length), self.pad_id, dtype=np.int64)
        mask = np.zeros((len(encodings), length), dtype=np.int64)
        truncated = []
        for row, enc in enumerate(encodings):
            ids[row, : len(enc.ids)] = enc.ids
            mask[row, : len(enc.ids)] = 1
            truncated.append(bool(enc.overflowing))
        if any(truncated):
            log.warning(
                "%d of %d texts exceed %d tokens and were truncated",
                sum(truncated), len(truncated), self.max_tokens,
            )
        return TokenBatch(ids, mask, truncated)

    def fingerprints(self, texts: Sequence[str]) -> list[str]:
        """A digest of each text's token ids: two texts share one exactly when the model gets the same
        input, whatever this vocabulary's rules for case, spacing and special tokens (a cache key: "US"
        and "us" share one under an uncased vocabulary only)."""
        return [fingerprint for fingerprint, _ in self.fingerprints_and_truncation(texts)]

    def fingerprints_and_truncation(self, texts: Sequence[str]) -> list[tuple[str, bool]]:
        """``fingerprints`` and whether each text was truncated, from one tokenisation (a cache hit then
        needs no other)."""
        return [(hashlib.blake2b(np.asarray(e.ids, np.int32).tobytes(), digest_size=16).hexdigest(), bool(e.overflowing))
                for e in self.encode(texts)]

    def is_truncated(self, texts: Sequence[str]) -> list[bool]:
        return [bool(e.overflowing) for e in self.encode(texts)]
