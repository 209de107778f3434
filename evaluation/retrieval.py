"""Text-to-image and image-to-text recall with several captions per image."""

from __future__ import annotations

from typing import Sequence

import numpy as np

from paraseek.core.errors import UserError
from paraseek.core.rank_metrics import retrieval_recall
from paraseek.paraphrase.expansions import ConfidentLead, HubCorrection, KeepFirst

KS = (1, 5, 10)


def cross_modal_recall(image_vecs: np.ndarray, image_ids: Sequence[int], text_vecs: np.ndarray,
                       text_image_ids: Sequence[int], ks=KS, plain_text_vecs: np.ndarray | None = None,
                       keep: KeepFirst = KeepFirst(), lead_text_vecs: np.ndarray | None = None,
                       lead: ConfidentLead = ConfidentLead(), hub: HubCorrection = HubCorrection(),
                       image_bias: np.ndarray | None = None) -> dict[str, float]:
    """R@k in percent both ways, and RSUM. A caption's relevant image is its own; an image's relevant
    captions are all of its captions. ``keep`` (with the unexpanded ``plain_text_vecs``): text
    to image ranks as an expansion with ``keep_first`` (and ``keep_blend``) serves them; ``lead`` (with a second tower's
    ``lead_text_vecs``): as its ``lead_margin`` then serves them; ``hub`` (with each image's ``image_bias``):
    the text tower's scores less ``hub.weight`` x the bias first (over the whole gallery, where the service
    reorders its first ``HUB_SHORTLIST``: the same order wherever the first 10 corrected lie within them)."""
    position = {int(i): p for p, i in enumerate(image_ids)}
    missing = {int(i) for i in text_image_ids} - set(position)
    if missing:
        raise UserError(f"{len(missing)} captions refer to images not in the gallery, e.g. {sorted(missing)[:3]}")
    sim = np.asarray(text_vecs, np.float32) @ np.asarray(image_vecs, np.float32).T
    shift = hub.weight * np.asarray(image_bias, np.float32)[None] if hub and image_bias is not None else 0.0
    t2i_sim = sim - shift
    kept, led = keep and plain_text_vecs is not None, lead and lead_text_vecs is not None
    if kept or led:
        served: list[list[int]] = np.argsort(-t2i_sim, axis=1).tolist()
        if kept:
            kept_vecs = keep.query(np.asarray(plain_text_vecs, np.float32), np.asarray(text_vecs, np.float32))
            plain_sim = kept_vecs @ np.asarray(image_vecs, np.float32).T
            plain = np.argsort(-(plain_sim - shift), axis=1)
            served = [keep.serve(p, e) for p, e in zip(plain, served)]
        if led:
            lead_sim = np.asarray(lead_text_vecs, np.float32) @ np.asarray(image_vecs, np.float32).T
            top2 = np.argsort(-lead_sim, axis=1)[:, :2]
            served = [lead.serve(e, t, s[t]) for e, t, s in zip(served, top2, lead_sim)]
        t2i_sim = np.empty_like(sim)
        descending = np.arange(sim.shape[1], 0, -1, dtype=np.float32)  # a score that orders as the served list
        for row, order in enumerate(served):
            t2i_sim[row, order] = descending
    t2i = retrieval_recall(t2i_sim, [position[int(i)] for i in text_image_ids], ks)
    captions_of: dict[int, set[int]] = {}
    for t, i in enumerate(text_image_ids):
        captions_of.setdefault(position[int(i)], set()).add(t)
    rows = [p for p in range(len(image_ids)) if p in captions_of]
    i2t = retrieval_recall(sim.T[rows], [captions_of[p] for p in rows], ks)
    out = {f"t2i_r{k}": 100 * t2i[k] for k in ks} | {f"i2t_r{k}": 100 * i2t[k] for k in ks}
    out["rsum"] = sum(out.values())
    return out
