import numpy as np
import pytest

from paraseek.core.rank_metrics import average_overlap, jaccard_at_k, overlap_recall, retrieval_recall


pytestmark = pytest.mark.quick


def test_identical_lists_score_one():
    assert average_overlap([1, 2, 3, 4], [1, 2, 3, 4]) == 1.0
    assert jaccard_at_k([1, 2, 3, 4], [1, 2, 3, 4]) == 1.0


def test_disjoint_lists_score_zero():
    assert average_overlap([1, 2, 3], [4, 5, 6]) == 0.0
    assert jaccard_at_k([1, 2, 3], [4, 5, 6]) == 0.0


def test_partial_overlap_worked_examples():
    # A=[1,2,3], B=[2,1,3]: d=1 -> 0/1, d=2 -> 2/2, d=3 -> 3/3 ; AO = (0 + 1 + 1) / 3
    assert average_overlap([1, 2, 3], [2, 1, 3]) == pytest.approx(2 / 3)
    # A=[1,2,3,4], B=[1,5,2,6]: 1/1, 1/2, 2/3, 2/4 -> AO = (1 + .5 + .6667 + .5) / 4
    assert average_overlap([1, 2, 3, 4], [1, 5, 2, 6]) == pytest.approx((1 + 0.5 + 2 / 3 + 0.5) / 4)
    # same sets, order reversed: JS is 1 while AO is below 1 (AO is rank-aware)
    assert jaccard_at_k([1, 2, 3, 4], [4, 3, 2, 1]) == 1.0
    assert average_overlap([1, 2, 3, 4], [4, 3, 2, 1]) == pytest.approx((0 + 0 + 2 / 3 + 1) / 4)
    # |{2,3}| / |{1,2,3,4}|
    assert jaccard_at_k([1, 2, 3], [2, 3, 4]) == pytest.approx(0.5)


def test_ao_matches_definition_on_random_lists():
    rng = np.random.default_rng(0)
    for _ in range(300):
        k = int(rng.integers(1, 12))
        a = rng.permutation(20)[:k].tolist()
        b = rng.permutation(20)[:k].tolist()
        ref = sum(len(set(a[:d]) & set(b[:d])) / d for d in range(1, k + 1)) / k
        assert average_overlap(a, b, k) == pytest.approx(ref)


def test_k_cuts_the_lists():
    assert jaccard_at_k([1, 2, 9], [1, 2, 8], k=2) == 1.0
    assert average_overlap([1, 2, 9], [1, 2, 8], k=2) == 1.0


def test_overlap_recall_ignores_missing_results():
    exact = np.array([[1, 2], [3, 4]])
    approx = np.array([[2, -1], [5, 6]])
    assert overlap_recall(approx, exact) == pytest.approx(0.25)


def test_retrieval_recall():
    sim = np.array([[0.9, 0.1, 0.0], [0.2, 0.3, 0.8], [0.5, 0.4, 0.1]])
    r = retrieval_recall(sim, [0, 1, {1, 2}], ks=(1, 2))
    assert r[1] == pytest.approx(1 / 3)
    assert r[2] == pytest.approx(3 / 3)
