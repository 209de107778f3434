"""Query expansion as the evaluation harness applies it: a spec string -> a function from (texts,
their plain embeddings) to the expanded query vectors, with the same arithmetic the service uses
(``paraseek.core.query_vectors``).

Specs: every method of the registry (``paraseek.paraphrase.expansions``), each with its own arguments:
``wordnet:N[:MIN_COS]``, ``ppdb:N[:MIN_COS]`` (text rewrites; rewrites whose embedding has a cosine
below MIN_COS to the query's are dropped, the guard), ``bank:N[:mean|weighted]`` (caption bank
neighbours), ``head[:ROUNDS[:N]]`` (the bank's query head, then ROUNDS bank rounds of N neighbours),
``prf:M[:ALPHA:BETA]`` (Rocchio feedback from the top M images), ``none:hubW`` (the query as it is, the
hub correction alone). Any spec may end with
``:keepK`` or ``:keepKinW``: the unexpanded query's first K results lead the list (the request's
``keep_first``; with ``inW`` only those the expanded list ranks within its first W, ``keep_within``; with
``@B`` those of the query moved the share B of the way to its expanded vector, ``keep_blend``),
then ``:leadM``: a second tower's first answer (``--first-answer-bundle``) goes on top where its first
image's score exceeds its second's by more than M (the request's ``lead_margin``), then ``:hubW``: the
served tower's lists ordered by score less W x each image's hubness against the caption bank (the
request's ``hub_weight``).
"""

from __future__ import annotations

import asyncio
import functools
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np

from paraseek.core.encoder import Encoder
from paraseek.core.errors import UserError
from paraseek.core.query_vectors import close_to_query, mean_fusion
from paraseek.core.settings import Settings
from paraseek.index.snapshot import Snapshot
from paraseek.paraphrase.caption_bank import CaptionBank, configured_bank_dir
from paraseek.paraphrase.expansions import (
    EXPANSIONS,
    ConfidentLead,
    HubCorrection,
    KeepFirst,
    RewriteExpansion,
    VectorExpansion,
    expansion_method,
)
from paraseek.paraphrase.factory import make_source

Expander = Callable[[list[str], np.ndarray], np.ndarray]


@dataclass
class Expansion:
    label: str
    expand: Expander
    keep: KeepFirst = KeepFirst()  # the unexpanded query's first results lead each list (``:keepK[inW]``)
    lead: ConfidentLead = ConfidentLead()  # a second tower's sure first answer goes on top (``:leadM``)
    lead_encoder: Encoder | None = None  # that tower (``--first-answer-bundle``), where ``lead`` is set
    hub: HubCorrection = HubCorrection()  # lists ordered by hub-corrected scores (``:hubW``)
    image_bias: np.ndarray | None = None  # where ``hub`` is set: each snapshot row's ``CaptionBank.hub_bias``


def split_rules(spec: str) -> tuple[list[str], KeepFirst, ConfidentLead, HubCorrection]:
    """A spec's parts, its ``keepK`` or ``keepKinW`` suffix, then its ``leadM`` one, then its ``hubW`` one
    (``bank:30:keep1in5:lead0.03:hub0.5`` -> (["bank", "30"], KeepFirst(1, 5), ConfidentLead(0.03),
    HubCorrection(0.5))); none without them."""
    parts, lead, hub = spec.split(":"), ConfidentLead(), HubCorrection()
    if len(parts) > 1 and parts[-1].startswith("hub"):
        match = re.fullmatch(r"hub(\d+(?:\.\d*)?|\.\d+)", parts[-1])
        if match is None or not 0 < float(match.group(1)) <= 2:
            raise UserError(f"--expansion {spec!r}: {parts[-1]!r} is not hubW (W a weight, above 0 and at most 2)")
        parts, hub = parts[:-1], HubCorrection(float(match.group(1)))
    if len(parts) > 1 and parts[-1].startswith("lead"):
        match = re.fullmatch(r"lead(\d+(?:\.\d*)?|\.\d+)", parts[-1])
        if match is None or not 0 <= float(match.group(1)) <= 2:
            raise UserError(f"--expansion {spec!r}: {parts[-1]!r} is not leadM (M a score margin, 0 to 2)")
        parts, lead = parts[:-1], ConfidentLead(float(match.group(1)))
    if len(parts) > 1 and parts[-1].startswith("keep"):
        match = re.fullmatch(r"keep(\d+)(?:in(\d+))?(?:@(\d*\.?\d+))?", parts[-1])
        if match is None or not 0 <= float(match.group(3) or 0) < 1:
            raise UserError(f"--expansion {spec!r}: {parts[-1]!r} is not keepK or keepKinW (whole numbers), "
                            "optionally @B (B a share of the expansion's move, 0 to below 1)")
        keep = KeepFirst(int(match.group(1)), int(match.group(2) or 0), float(match.group(3) or 0))
        return parts[:-1], keep, lead, hub
    return parts, KeepFirst(), lead, hub


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


class DirectLookups:
    """``Lookups`` by direct calls: the evaluation harness runs one batch at a time."""

    def __init__(self, snapshot: Snapshot, load_bank: Callable[[], CaptionBank]):
        self.snapshot, self._load_bank = snapshot, load_bank
        self._bank: CaptionBank | None = None

    async def caption_bank(self) -> CaptionBank:
        if self._bank is None:
            self._bank = self._load_bank()
        return self._bank

    async def bank_neighbours(self, bank: CaptionBank, queries: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray]:
        return bank.neighbours(queries, n)

    async def top_images(self, queries: np.ndarray, m: int) -> np.ndarray:
        return self.snapshot.search_ids(queries, m)[1]

    async def image_vectors(self, ids: np.ndarray) -> list[np.ndarray]:
        return self.snapshot.feedback_vectors(ids)


def parse_expansion(spec: str, encoder: Encoder, snapshot: Snapshot, settings: Settings | None = None,
                    ppdb: Path | None = None, bank: Path | None = None, first_answer: Encoder | None = None) -> Expansion:
    """``METHOD[:ARG...]`` of any registered expansion method (``paraseek.paraphrase.expansions``);
    ``first_answer``: the tower of a ``:leadM`` suffix."""
    settings = settings or Settings()
    (name, *args), keep, lead, hub = split_rules(spec)
    if lead and first_answer is None:
        raise UserError(f"--expansion {spec!r}: {lead.label} needs the tower whose first answer leads "
                        "(--first-answer-bundle)")
    if lead and first_answer is not None and first_answer.image_space != encoder.image_space:
        raise UserError(f"--expansion {spec!r}: the first-answer bundle {first_answer.path} embeds into image space "
                        f"{first_answer.image_space!r}, not {encoder.image_space!r} like {encoder.path}")
    lead_encoder = first_answer if lead else None
    # one load for both the hub bias and the lookups
    load_bank = functools.cache(lambda: CaptionBank.load(bank or configured_bank_dir(settings, encoder.manifest), encoder))

    def image_bias() -> np.ndarray | None:  # read once the spec is known to be valid
        return load_bank().hub_bias(np.asarray(snapshot.vectors())) if hub else None

    if name == "none":  # ``none:hubW``: the correction alone, the query as it is
        if args or keep or lead or not hub:
            raise UserError(f"--expansion {spec!r}: none takes only :hubW (the hub correction without an expansion)")
        return Expansion(f"none-{hub.label}", lambda texts, vectors: vectors, hub=hub, image_bias=image_bias())
    try:
        method = expansion_method(name)
        params = method.from_spec(args)
        method.check(params)
    except ValueError as exc:
        raise UserError(f"--expansion {spec!r}: {exc}") from None
    label = (method.spec_label(params) + (f"-{keep.label}" if keep else "") + (f"-{lead.label}" if lead else "")
             + (f"-{hub.label}" if hub else ""))
    if isinstance(method, RewriteExpansion):
        if params.fusion != "mean":
            raise UserError(f"--expansion {spec!r}: the harness fuses rewrites by their mean")
        source = make_source(method.source, settings, ppdb_path=ppdb)
        return Expansion(label, guarded_text_expander(encoder, lambda t: source.paraphrases(t, params.n), params.min_cos),
                         keep, lead, lead_encoder, hub, image_bias())
    assert isinstance(method, VectorExpansion)
    lookups = DirectLookups(snapshot, load_bank)
    return Expansion(label, lambda texts, vectors: asyncio.run(method.expand(vectors, params, lookups))[0], keep, lead,
                     lead_encoder, hub, image_bias())


def spec_help() -> str:
    return ", ".join(m.spec_help for m in EXPANSIONS.values())
