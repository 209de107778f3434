"""The fusion arithmetic, checked against hand computations on tiny vectors."""

import numpy as np
import pytest

from paraseek.core.query_vectors import mean_fusion, rocchio, weighted_fusion


pytestmark = pytest.mark.quick


def unit(*v):
    v = np.asarray(v, np.float32)
    return v / np.linalg.norm(v)


def test_mean_fusion_is_eq5():
    q, e1, e2 = unit(1, 0, 0), unit(0, 1, 0), unit(0, 0, 1)
    # (q + e1 + e2) / 3 = (1/3, 1/3, 1/3) -> normalised (1, 1, 1) / sqrt 3
    assert mean_fusion(q, np.stack([e1, e2])) == pytest.approx(np.full(3, 1 / np.sqrt(3)))
    batch = mean_fusion(np.stack([q, e1]), np.stack([np.stack([e1, e1]), np.stack([q, q])]))
    # row 0: (q + 2 e1) / 3 -> (1, 2, 0) / sqrt 5; row 1: (e1 + 2 q) / 3 -> (2, 1, 0) / sqrt 5
    assert batch == pytest.approx(np.array([[1, 2, 0], [2, 1, 0]]) / np.sqrt(5))


def test_weighted_fusion_weights_by_softmax_of_similarity():
    q, e1, e2 = unit(1, 0), unit(1, 1), unit(-1, 1)
    sims = np.array([0.9, 0.1])
    w = np.exp(sims / 0.5)
    w /= w.sum()
    expected = 0.5 * q + 0.5 * (w[0] * e1 + w[1] * e2)
    got = weighted_fusion(q, np.stack([e1, e2]), sims, temperature=0.5)
    assert got == pytest.approx(expected / np.linalg.norm(expected), abs=1e-6)
    # a very low temperature keeps only the most similar expansion
    sharp = weighted_fusion(q, np.stack([e1, e2]), sims, temperature=1e-4)
    assert sharp == pytest.approx(unit(*(0.5 * q + 0.5 * e1)), abs=1e-6)


def test_rocchio_moves_toward_the_feedback_mean():
    q = unit(1, 0)
    fb = np.stack([unit(0, 1), unit(1, 1)])
    expected = 2.0 * q + 0.5 * fb.mean(axis=0)
    assert rocchio(q, fb, alpha=2.0, beta=0.5) == pytest.approx(expected / np.linalg.norm(expected))
    assert rocchio(q, fb, alpha=1.0, beta=0.0) == pytest.approx(q)


def test_rocchio_takes_feedback_of_different_lengths_and_none():
    """A filtered or approximate search can return fewer hits for one query than another, or none:
    each query moves toward its own hits' mean, and one without hits stays itself (never NaN)."""
    queries = np.stack([unit(1, 0), unit(0, 1), unit(1, 1)])
    feedback = [np.stack([unit(0, 1), unit(1, 1)]), unit(1, 0)[None], np.zeros((0, 2), np.float32)]
    out = rocchio(queries, feedback, alpha=1.0, beta=1.0)
    assert np.isfinite(out).all()
    assert out[0] == pytest.approx(unit(*(queries[0] + feedback[0].mean(axis=0))))
    assert out[1] == pytest.approx(unit(*(queries[1] + feedback[1][0])))
    assert out[2] == pytest.approx(queries[2])
    with pytest.raises(ValueError, match="2 feedback sets for 3 queries"):
        rocchio(queries, feedback[:2])
