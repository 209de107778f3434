"""The service's caption-bank lookups: each image's hubness, computed once and kept within a bound, then the
whole index version's table, kept on disk."""

import logging
import threading
from types import SimpleNamespace

import numpy as np
import pytest

from paraseek.core.settings import Settings
from paraseek.service import expansion_sources
from paraseek.service.expansion_sources import ExpansionSources

pytestmark = pytest.mark.quick


class CountingSnapshot:
    """Stored vectors by id, counting the ids asked for and the whole-version reads."""

    def __init__(self, vectors: dict[int, np.ndarray], version: str, fail_reads: bool = False):
        self.stored, self.version, self.asked, self.reads, self.fail_reads = vectors, version, [], 0, fail_reads
        self.manifest = SimpleNamespace(backend="faiss", version=version, created_at="2026-11-28T00:00:00+00:00",
                                        count=len(vectors))

    def __len__(self):
        return len(self.stored)

    def vectors_of(self, ids):
        self.asked.append(list(ids))
        return np.stack([self.stored[int(i)] for i in ids])

    def iter_contents(self, chunk=3):
        self.reads += 1
        if self.fail_reads:
            raise ConnectionError("the vector database went away")
        ids = list(self.stored)
        for at in range(0, len(ids), chunk):
            part = ids[at:at + chunk]
            yield np.array(part), np.stack([self.stored[i] for i in part]), [{}] * len(part)


def unit_vectors(dim, ids):
    rng = np.random.default_rng(0)
    return {i: v / np.linalg.norm(v) for i, v in zip(ids, rng.normal(size=(len(ids), dim)))}


def hubness(bank, vectors: dict[int, np.ndarray]) -> dict[int, float]:
    return dict(zip(vectors, bank.hub_bias(np.stack(list(vectors.values()))).tolist()))


def sources_with(bank, home, monkeypatch) -> ExpansionSources:
    sources = ExpansionSources(Settings(home=home))
    monkeypatch.setattr(sources, "caption_bank", lambda active: bank)
    return sources


def build_table(sources: ExpansionSources, active) -> None:
    build = sources.start_hub_table(active)
    assert build is not None
    build.join(timeout=60)


def test_hub_bias_is_the_banks_computed_once_per_image_and_snapshot(starter_bank, monkeypatch, tmp_path):
    vectors = unit_vectors(starter_bank.manifest.dim, range(10, 18))
    sources = ExpansionSources(Settings(home=tmp_path))
    monkeypatch.setattr(sources, "caption_bank", lambda active: starter_bank)
    monkeypatch.setattr(sources, "start_hub_table", lambda active, bank=None: None)  # per image only, here
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


def test_the_versions_hub_table_replaces_per_image_hubness_and_outlives_a_restart(starter_bank, monkeypatch, tmp_path):
    vectors = unit_vectors(starter_bank.manifest.dim, range(20, 31))
    want = hubness(starter_bank, vectors)
    snap = CountingSnapshot(vectors, "v1")
    active = SimpleNamespace(model_id="m:1:fp32", snapshot=snap)
    asked = np.array([[22, 30, -1], [21, 22, 29]])
    expected = [[want[22], want[30], 0.0], [want[21], want[22], want[29]]]

    sources = sources_with(starter_bank, tmp_path, monkeypatch)
    try:
        build = sources.start_hub_table(active)
        assert build is not None and sources.start_hub_table(active) is None  # one build a version
        build.join(timeout=60)
        assert snap.reads == 1 and len(list((tmp_path / "hub-tables").glob("*.npz"))) == 1
        np.testing.assert_allclose(sources.hub_bias(active, asked), expected, rtol=1e-5)
        assert snap.asked == []  # the table answered: no stored vector read per image
    finally:
        sources.shutdown()

    restarted = sources_with(starter_bank, tmp_path, monkeypatch)
    try:
        # the first call computes per image and asks for the table, which is read back, not computed again
        np.testing.assert_allclose(restarted.hub_bias(active, asked), expected, rtol=1e-5)
        assert snap.asked == [[21, 22, 29, 30]]
        for thread in [t for t in threading.enumerate() if t.name == "hub-table"]:
            thread.join(timeout=60)
        assert snap.reads == 1
        np.testing.assert_allclose(restarted.hub_bias(active, np.array([[20, 25]])), [[want[20], want[25]]], rtol=1e-5)
        assert snap.asked == [[21, 22, 29, 30]]  # 20 and 25 came from the table

        other = CountingSnapshot(vectors, "v2")  # a new version gets a table of its own
        build_table(restarted, SimpleNamespace(model_id="m:1:fp32", snapshot=other))
        assert other.reads == 1 and len(list((tmp_path / "hub-tables").glob("*.npz"))) == 2
        build_table(restarted, active)  # v1 served again (a rollback): its table is read back
        assert snap.reads == 1
        np.testing.assert_allclose(restarted.hub_bias(active, np.array([[24]])), [[want[24]]], rtol=1e-5)
        assert snap.asked == [[21, 22, 29, 30]]
    finally:
        restarted.shutdown()


def test_a_hub_table_that_cannot_be_built_leaves_per_image_hubness_serving(starter_bank, monkeypatch, tmp_path, caplog):
    vectors = unit_vectors(starter_bank.manifest.dim, range(5))
    want = hubness(starter_bank, vectors)
    snap = CountingSnapshot(vectors, "v1", fail_reads=True)
    active = SimpleNamespace(model_id="m:1:fp32", snapshot=snap)
    sources = sources_with(starter_bank, tmp_path, monkeypatch)
    try:
        with caplog.at_level(logging.ERROR, logger="paraseek.service.expansion_sources"):
            build_table(sources, active)
        assert "no hub table for index version v1" in caplog.text
        assert sources.start_hub_table(active) is None  # not tried again for this version
        np.testing.assert_allclose(sources.hub_bias(active, np.array([[3, 1]])), [[want[3], want[1]]], rtol=1e-5)
        assert snap.asked == [[1, 3]] and not (tmp_path / "hub-tables").exists()
    finally:
        sources.shutdown()


def test_a_hub_table_that_cannot_be_written_still_serves_from_memory(starter_bank, monkeypatch, tmp_path, caplog):
    vectors = unit_vectors(starter_bank.manifest.dim, range(6))
    want = hubness(starter_bank, vectors)
    (tmp_path / "hub-tables").write_text("a file where the folder would be")  # the home refuses the table
    active = SimpleNamespace(model_id="m:1:fp32", snapshot=(snap := CountingSnapshot(vectors, "v1")))
    sources = sources_with(starter_bank, tmp_path, monkeypatch)
    try:
        with caplog.at_level(logging.WARNING, logger="paraseek.paraphrase.hub_table"):
            build_table(sources, active)
        assert "hub table not written" in caplog.text
        np.testing.assert_allclose(sources.hub_bias(active, np.array([[4, 0]])), [[want[4], want[0]]], rtol=1e-5)
        assert snap.asked == [] and snap.reads == 1  # from the table in memory
    finally:
        sources.shutdown()


def test_a_prepared_hub_table_is_installed_when_its_version_serves(starter_bank, monkeypatch, tmp_path):
    """A reindex computes the new version's table before its swap; the swap installs it with no read of the
    version and no per-image product; a tower whose bank is not loaded (a reindex with another bundle) is left
    to the build after its swap."""
    vectors = unit_vectors(starter_bank.manifest.dim, range(40, 52))
    want = hubness(starter_bank, vectors)
    sources = sources_with(starter_bank, tmp_path, monkeypatch)
    serving = SimpleNamespace(model_id="m:1:fp32", snapshot=CountingSnapshot(vectors, "v1"))
    new = SimpleNamespace(model_id="m:1:fp32", snapshot=(snap := CountingSnapshot(vectors, "v2")))
    try:
        assert sources.prepare_hub_table(new) is None  # no bank loaded yet: nothing prepared
        monkeypatch.setattr(sources, "loaded_bank", lambda active: starter_bank if active.model_id == "m:1:fp32" else None)
        seconds = sources.prepare_hub_table(new)
        assert seconds is not None and snap.reads == 1 and len(list((tmp_path / "hub-tables").glob("*.npz"))) == 1
        build_table(sources, serving)  # the version serving meanwhile keeps its own table
        np.testing.assert_allclose(sources.hub_bias(serving, np.array([[41]])), [[want[41]]], rtol=1e-5)

        assert sources.start_hub_table(new) is None  # the swap: installed at once, no thread
        np.testing.assert_allclose(sources.hub_bias(new, np.array([[50, 44]])), [[want[50], want[44]]], rtol=1e-5)
        assert snap.reads == 1 and snap.asked == []

        other_tower = SimpleNamespace(model_id="other:1:fp32", snapshot=CountingSnapshot(vectors, "v3"))
        assert sources.prepare_hub_table(other_tower) is None and other_tower.snapshot.reads == 0
    finally:
        sources.shutdown()
