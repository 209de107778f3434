"""Query expansion as the evaluation harness applies it: a spec string -> a function from (texts,
their plain embeddings) to the expanded query vectors, with the same arithmetic the service uses
(``paraseek.core.query_vectors``).

Specs: ``wordnet:N[:MIN_COS]``, ``ppdb:N[:MIN_COS]`` (text rewrites; rewrites whose embedding has a
cosine below MIN_COS to the query's are dropped, the guard), ``bank:N[:mean|weighted]`` (caption bank
neighbours), ``prf:M[:ALPHA:BETA]`` (Rocchio feedback from the top M images).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np

from paraseek.core.encoder import Encoder
from paraseek.core.errors import UserError
from paraseek.core.query_vectors import close_to_query, mean_fusion, rocchio
from paraseek.core.settings import Settings
from paraseek.index.snapshot import Snapshot
from paraseek.paraphrase.caption_bank import CaptionBank, bank_dir
from paraseek.paraphrase.factory import make_source

Expander = Callable[[list[str], np.ndarray], np.ndarray]


@dataclass
class Expansion:
    label: str
    expand: Expander


def _number(spec: str, text: str, kind=float):
    try:
        return kind(text)
    except ValueError:
        raise UserError(f"--expansion {spec!r}: {text!r} is not a number") from None


def guarded_text_expander(encoder: Encoder, rewrite: Callable[[str], list[str]], min_cos: float) -> Expander:
    """Eq. 5 over the query and those of its rewrites whose embedding stays within ``min_cos`` of it."""

    def expand(texts: list[str], vectors: np.ndarray) -> np.ndarray:
        out = np.empty_like(vectors)
        for i, (text, vec) in enumerate(zip(texts, vectors)):
            rewrites = rewrite(text)
            kept = np.zeros((0, vectors.shape[1]), np.float32)
            if rewrites:
                emb = encoder.encode_text(rewrites)
                kept = emb[close_to_query(vec, emb, min_cos)]
            out[i] = mean_fusion(vec, kept) if len(kept) else vec
        return out

    return expand


def parse_expansion(spec: str, encoder: Encoder, snapshot: Snapshot, settings: Settings | None = None,
                    ppdb: Path | None = None, bank: Path | None = None) -> Expansion:
    settings = settings or Settings()
    method, *args = spec.split(":")
    if method in ("wordnet", "ppdb"):
        n = _number(spec, args[0], int) if args else 3
        min_cos = _number(spec, args[1]) if len(args) > 1 else -1.0
        source = make_source(method, settings, ppdb_path=ppdb)
        label = f"{method}{n}" + (f"@cos{min_cos:g}" if min_cos > -1 else "")
        return Expansion(label, guarded_text_expander(encoder, lambda t: source.paraphrases(t, n), min_cos))
    if method == "bank":
        n = _number(spec, args[0], int) if args else 30
        fusion = args[1] if len(args) > 1 else "mean"
        caption_bank = CaptionBank.load(bank or settings.caption_bank or bank_dir(settings.home, encoder.manifest), encoder)
        return Expansion(f"bank{n}-{fusion}", lambda texts, vectors: caption_bank.expand(vectors, n, fusion))
    if method == "prf":
        m = _number(spec, args[0], int) if args else 5
        alpha = _number(spec, args[1]) if len(args) > 1 else 1.0
        beta = _number(spec, args[2]) if len(args) > 2 else 1.0

        def feedback(texts: list[str], vectors: np.ndarray) -> np.ndarray:
            _, top = snapshot.search_ids(vectors, m)
            return rocchio(vectors, snapshot.feedback_vectors(top), alpha, beta)

        return Expansion(f"prf{m}-a{alpha:g}-b{beta:g}", feedback)
    raise UserError(f"--expansion {spec!r}: method must be wordnet, ppdb, bank or prf")
