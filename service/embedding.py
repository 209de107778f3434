"""A request's texts against the embedding cache: which vectors the cache has, which texts are left to
encode, and the rows of all of them once they are encoded."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from paraseek.core.encoder import Encoder
from paraseek.service.cache import Cache
from paraseek.service.runtime import encoder_id


@dataclass
class CachedTexts:
    """A request's texts, distinct ones once, with the vectors the cache has; ``missing`` are to encode."""

    texts: list[str]
    unique: list[str]
    found: dict[str, np.ndarray]
    missing: list[str]
    fingerprints: dict[str, str]  # text -> its cache key (empty with the cache off)
    truncation: dict[str, bool]  # text -> truncated, known from the same tokenisation

    @property
    def missing_fingerprints(self) -> list[str]:
        return [self.fingerprints.get(t, "") for t in self.missing]  # empty with the cache off: nothing is stored

    def assemble(self, encoder: Encoder, vectors: np.ndarray | None, flags: list[bool]) -> tuple[np.ndarray, list[bool]]:
        """Rows for ``texts`` and whether each was truncated, given the missing ones' vectors and flags."""
        found = dict(self.found)
        truncated: dict[str, bool] = {}
        if vectors is not None:
            for t, v, f in zip(self.missing, vectors, flags):
                found[t], truncated[t] = v, f
        # a cached vector does not say whether its text was truncated: the lookup's tokenisation did
        hits = [t for t in self.unique if t not in truncated]
        unknown = [t for t in hits if t not in self.truncation]
        truncated.update((t, self.truncation[t]) for t in hits if t in self.truncation)
        if unknown:
            truncated.update(zip(unknown, encoder.tokenizer.is_truncated(unknown)))
        return np.stack([found[t] for t in self.texts]), [truncated[t] for t in self.texts]


async def cached_texts(cache: Cache, encoder: Encoder, texts: list[str]) -> CachedTexts:
    """Looks ``texts`` up by the fingerprints of their token ids (one tokenisation, which also tells
    whether each was truncated) among ``encoder``'s cached vectors."""
    unique = list(dict.fromkeys(texts))
    keyed = encoder.tokenizer.fingerprints_and_truncation(unique) if cache.backend != "off" else []
    fingerprints = {t: f for t, (f, _) in zip(unique, keyed)}
    found_vectors = await cache.get_embeddings(encoder_id(encoder), [fingerprints.get(t, "") for t in unique], encoder.dim)
    found = {t: v for t, v in zip(unique, found_vectors) if v is not None}
    return CachedTexts(texts, unique, found, [t for t in unique if t not in found], fingerprints,
                       {t: cut for t, (_, cut) in zip(unique, keyed)})
