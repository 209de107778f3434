"""The service's caption-bank lookups: each image's hubness, computed once and kept within a bound."""

from types import SimpleNamespace

import numpy as np

from paraseek.core.settings import Settings
from paraseek.service import expansion_sources
from paraseek.service.expansion_sources import ExpansionSources


class CountingSnapshot:
    """Stored vectors by id, counting the ids asked for."""

    def __init__(self, vectors: dict[int, np.ndarray], version: str):
        self.stored, self.version, self.asked = vectors, version, []

    def vectors_of(self, ids):
        self.asked.append(list(ids))
        return np.stack([self.stored[int(i)] for i in ids])


def test_hub_bias_is_the_banks_computed_once_per_image_and_snapshot(starter_bank, monkeypatch, tmp_path):
    rng = np.random.default_rng(0)
    vectors = {i: v / np.linalg.norm(v) for i, v in zip(range(10, 18), rng.normal(size=(8, starter_bank.manifest.dim)))}
    sources = ExpansionSources(Settings(home=tmp_path))
    monkeypatch.setattr(sources, "caption_bank", lambda active: starter_bank)
    snap = CountingSnapshot(vectors, "v1")
    active = SimpleNamespace(model_id="m:1:fp32", snapshot=snap)
    want = dict(zip(vectors, starter_bank.hub_bias(np.stack(list(vectors.values()))).tolist()))
    try:
        got = sources.hub_bias(active, np.array([[12, 10, -1], [10, 13, 12]]))
        np.testing.assert_allclose(got, [[want[12], want[10], 0.0], [want[10], want[13], want[12]]], rtol=1e-5)
        assert snap.asked == [[10, 12, 13]]  # each image once, padding never
        np.testing.assert_allclose(sources.hub_bias(active, np.array([[13, 14]])), [[want[13], want[14]]], rtol=1e-5)
        assert snap.asked[1:] == [[14]]  # only the one not seen before

        monkeypatch.setattr(expansion_sources, "HUB_BIAS_KEPT", 3)  # four kept: past the bound, dropped
        np.testing.assert_allclose(sources.hub_bias(active, np.array([[15, 10]])), [[want[15], want[10]]], rtol=1e-5)
        assert snap.asked[2:] == [[10, 15]]  # computed again, from nothing

        other = CountingSnapshot(vectors, "v2")  # a new index version: its images are computed for it
        sources.hub_bias(SimpleNamespace(model_id="m:1:fp32", snapshot=other), np.array([[10]]))
        assert other.asked == [[10]]
    finally:
        sources.shutdown()
