"""How several vectors become one query vector: the one home of the fusion arithmetic that the
service and the evaluation harness share (Cheng et al. eq. 5, similarity weighting, Rocchio).

All inputs are L2-normalised rows; every result is L2-normalised."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from paraseek.core.encoder import l2_normalize


def mean_fusion(query: np.ndarray, expansions: np.ndarray) -> np.ndarray:
    """Cheng et al. eq. 5: the mean of the query's and its K expansions' embeddings.
    ``query`` (D,) or (Q, D); ``expansions`` (K, D) or (Q, K, D)."""
    q = np.atleast_2d(query)
    e = expansions.reshape(q.shape[0], -1, q.shape[1])
    out = l2_normalize((q + e.sum(axis=1)) / (e.shape[1] + 1))
    return out[0] if query.ndim == 1 else out


def close_to_query(query: np.ndarray, expansions: np.ndarray, min_cos: float) -> np.ndarray:
    """Mask of the expansions whose cosine to the query is at least ``min_cos`` (the guard that keeps
    a wrong synonym from moving the query)."""
    return expansions @ query >= min_cos


def weighted_fusion(query: np.ndarray, expansions: np.ndarray, similarities: np.ndarray,
                    temperature: float = 0.05, query_weight: float = 0.5) -> np.ndarray:
    """``query_weight`` * query + the rest * softmax(similarity / temperature)-weighted expansions."""
    q = np.atleast_2d(query)
    e = expansions.reshape(q.shape[0], -1, q.shape[1])
    s = np.atleast_2d(similarities) / temperature
    w = np.exp(s - s.max(axis=1, keepdims=True))
    w /= w.sum(axis=1, keepdims=True)
    out = l2_normalize(query_weight * q + (1 - query_weight) * np.einsum("qk,qkd->qd", w, e))
    return out[0] if query.ndim == 1 else out


def rocchio(query: np.ndarray, feedback: Sequence[np.ndarray], alpha: float = 1.0, beta: float = 1.0) -> np.ndarray:
    """Pseudo-relevance feedback: alpha * query + beta * mean of its top image vectors (Rocchio).

    ``feedback`` holds each query's top image vectors (for one 1-D query: its (m, D) array), as many as
    its search returned: a filtered or approximate search may return fewer than asked, or none, and a
    query without any stays as it is."""
    q = np.atleast_2d(query)
    if query.ndim == 1:
        feedback = [np.asarray(feedback)]
    if len(feedback) != len(q):
        raise ValueError(f"{len(feedback)} feedback sets for {len(q)} queries")
    mean = np.zeros_like(q)
    has = np.array([len(f) > 0 for f in feedback], dtype=bool)
    for row, f in enumerate(feedback):
        if len(f):
            mean[row] = np.asarray(f, q.dtype).reshape(-1, q.shape[1]).mean(axis=0)
    out = np.where(has[:, None], l2_normalize(alpha * q + beta * mean), l2_normalize(q))
    return out[0] if query.ndim == 1 else out
