"""STS: Spearman and Pearson correlation of cosine similarity with gold similarity scores."""

from __future__ import annotations

from typing import Sequence

import numpy as np

from paraseek.core.encoder import Encoder
from paraseek.evaluation.data import StsPair


def evaluate_sts(encoder: Encoder, pairs: Sequence[StsPair]) -> dict[str, float]:
    from scipy.stats import pearsonr, spearmanr

    a = encoder.encode_text([p.a for p in pairs])
    b = encoder.encode_text([p.b for p in pairs])
    cos = np.sum(a * b, axis=1)
    gold = np.array([p.score for p in pairs])
    return {"pairs": len(pairs), "spearman": float(spearmanr(cos, gold).statistic),
            "pearson": float(pearsonr(cos, gold).statistic)}
