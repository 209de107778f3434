"""Rank metrics shared by the service, the index and the evaluation harness.

AO@k and JS@k follow Cheng et al. exactly: for top-k lists A and B of a query and its paraphrase,
AO@k = (1/k) * sum_{d=1..k} |A_d ∩ B_d| / d  (A_d: the first d items of A), and
JS@k = |A_k ∩ B_k| / |A_k ∪ B_k|.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np


def average_overlap(a: Sequence, b: Sequence, k: int | None = None) -> float:
    """AO@k of two ranked lists (k defaults to the shorter length)."""
    k = k or min(len(a), len(b))
    if k <= 0:
        raise ValueError("k must be positive")
    seen_a: set = set()
    seen_b: set = set()
    common = 0  # |A_d ∩ B_d|, updated as d grows (items within one list are distinct)
    total = 0.0
    for d in range(k):
        x = a[d] if d < len(a) else None
        y = b[d] if d < len(b) else None
        if x is not None and x == y:
            common += 1
        else:
            common += (x is not None and x in seen_b) + (y is not None and y in seen_a)
        seen_a.add(x)
        seen_b.add(y)
        total += common / (d + 1)
    return total / k


def jaccard_at_k(a: Sequence, b: Sequence, k: int | None = None) -> float:
    """JS@k: Jaccard similarity of the two top-k sets."""
    k = k or min(len(a), len(b))
    sa, sb = set(a[:k]), set(b[:k])
    union = sa | sb
    return len(sa & sb) / len(union) if union else 1.0


def overlap_recalls(approx_ids: np.ndarray, exact_ids: np.ndarray) -> np.ndarray:
    """Each query's recall: the fraction of its exact top-k found in its approximate top-k (negative
    ids, FAISS' "no result", never count)."""
    k = exact_ids.shape[1]
    return np.array([len(set(a[a >= 0].tolist()) & set(e.tolist())) / k for a, e in zip(approx_ids, exact_ids)], float)


def overlap_recall(approx_ids: np.ndarray, exact_ids: np.ndarray) -> float:
    """Recall of an approximate search: the mean of ``overlap_recalls`` (1.0 for no queries)."""
    hits = overlap_recalls(approx_ids, exact_ids)
    return float(hits.mean()) if len(hits) else 1.0


def retrieval_recall(similarity: np.ndarray, relevant: Sequence[set[int] | int], ks=(1, 5, 10)) -> dict[int, float]:
    """Recall@k for a query x gallery similarity matrix: the fraction of queries with at least one
    relevant gallery item among their top k (ties are broken against the query)."""
    similarity = np.asarray(similarity)
    out = {}
    best_rank = np.empty(len(similarity), dtype=np.int64)
    for q, rel in enumerate(relevant):
        rel = {rel} if isinstance(rel, (int, np.integer)) else set(rel)
        row = similarity[q]
        rel_idx = np.fromiter(rel, dtype=np.int64)
        best = row[rel_idx].max()
        best_rank[q] = int((row > best).sum())
    for k in ks:
        out[k] = float((best_rank < k).mean())
    return out
