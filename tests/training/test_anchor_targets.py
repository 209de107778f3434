"""Bank anchor targets that leave a text's own paraphrase set out of its neighbours."""

import numpy as np

from paraseek.core.query_vectors import mean_fusion
from paraseek.paraphrase.caption_bank import CaptionBank
from paraseek.training.trainer import _expand_leaving_own_out


def _unit(rows):
    rows = np.asarray(rows, np.float32)
    return rows / np.linalg.norm(rows, axis=1, keepdims=True)


def test_own_set_and_its_rewrites_are_left_out_and_the_nearest_others_kept():
    groups = [["a dog", "a puppy"], ["a cat", "a kitten"], ["a car"]]
    captions = [c for g in groups for c in g]
    # the two dog captions are each other's nearest; the cats come next, the car last
    vectors = _unit([[1, 0.05, 0], [1, -0.05, 0], [0.8, 0.6, 0], [0.7, 0.7, 0], [0, 0, 1]])
    bank = CaptionBank.in_memory(captions, vectors)
    rewrites = {"a dog": (None, "a hound")}
    texts = [*captions, "a hound"]
    plain = np.vstack([vectors, _unit([[1, 0.0, 0.01]])])
    got = _expand_leaving_own_out(bank, groups, rewrites, texts, plain, n=2)
    # "a dog": its own set (itself, "a puppy") out, the two cats in
    np.testing.assert_allclose(got[0], mean_fusion(plain[0], vectors[[2, 3]]), atol=1e-6)
    # the rewrite of "a dog" belongs to its set: the same neighbours
    np.testing.assert_allclose(got[5], mean_fusion(plain[5], vectors[[2, 3]]), atol=1e-6)
    # "a cat": the dogs are nearer than the car, its kitten is its own
    np.testing.assert_allclose(got[2], mean_fusion(plain[2], vectors[[0, 1]]), atol=1e-6)
    # the plain expansion keeps the own set: the dog's nearest are itself and the puppy
    np.testing.assert_allclose(bank.expand(plain[:1], 2)[0], mean_fusion(plain[0], vectors[[0, 1]]), atol=1e-6)
