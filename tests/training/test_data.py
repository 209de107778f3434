"""Training batches: which human caption a caption takes as its x'."""

import numpy as np

from paraseek.training.data import close_captions


def _unit(rows):
    rows = np.asarray(rows, np.float32)
    return rows / np.linalg.norm(rows, axis=1, keepdims=True)


def test_close_captions_keeps_the_near_ones_and_falls_back_to_the_nearest():
    groups = [["a dog on a sofa", "a puppy on a couch", "a lamp in the corner"], ["a red bus", "a bus stop"],
              ["one", "one"]]
    texts = [t for g in groups for t in g]
    vectors = dict(zip(texts, _unit([[1, 0.1, 0], [1, 0.2, 0], [0, 1, 0.2], [0, 0, 1], [0.3, 0, 1], [1, 1, 1], [1, 1, 1]])))
    got = close_captions(groups, vectors, min_cos=0.9)
    # the dog and the puppy are each other's only close caption; the lamp (another part of the photo) has
    # none above 0.9, so it keeps its nearest, and nobody takes it
    assert got["a dog on a sofa"] == ["a puppy on a couch"] and got["a puppy on a couch"] == ["a dog on a sofa"]
    assert got["a lamp in the corner"] == ["a puppy on a couch"]
    assert got["a red bus"] == ["a bus stop"] and got["a bus stop"] == ["a red bus"]
    assert "one" not in got  # a set of one distinct text has no other caption
    assert close_captions(groups, vectors, min_cos=-1)["a dog on a sofa"] == ["a puppy on a couch", "a lamp in the corner"]
