"""A whole index version's hubness: computed chunk by chunk, looked up by id, written whole, refused when stale."""

import logging
import os
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from paraseek.paraphrase import hub_table
from paraseek.paraphrase.caption_bank import CaptionBank
from paraseek.paraphrase.hub_table import (
    HubTable,
    hub_table_for,
    hub_table_key,
    hub_table_path,
    prune_hub_tables,
    version_identity,
    written_hub_table,
)


pytestmark = pytest.mark.quick


def unit_rows(rng, n, dim):
    v = rng.normal(size=(n, dim)).astype(np.float32)
    return v / np.linalg.norm(v, axis=1, keepdims=True)


def small_bank(rng, dim=16, n=40):
    texts = [f"caption {i}" for i in range(n)]
    return CaptionBank.in_memory(texts, unit_rows(rng, n, dim))


def chunks(ids, vectors, size):
    for at in range(0, len(ids), size):
        yield ids[at:at + size], vectors[at:at + size], [{}] * len(ids[at:at + size])


def test_the_table_is_the_banks_hubness_of_every_image_looked_up_by_id(monkeypatch):
    monkeypatch.setattr(hub_table, "IMAGES_PER_PRODUCT", 5)  # chunks of 7 images, each in two products
    rng = np.random.default_rng(0)
    bank = small_bank(rng)
    ids = rng.permutation(np.arange(100, 150))  # any order, as a backend yields them
    vectors = unit_rows(rng, len(ids), 16)
    table = HubTable.compute(bank, chunks(ids, vectors, 7))
    want = dict(zip(ids.tolist(), bank.hub_bias(vectors).tolist()))
    assert len(table) == 50 and np.all(np.diff(table.ids) > 0)
    asked = np.array([[120, 101, -1], [149, 999, 100]])
    bias, missing = table.lookup(asked)
    np.testing.assert_allclose(bias, [[want[120], want[101], 0.0], [want[149], 0.0, want[100]]], rtol=1e-5)
    assert missing.tolist() == [[False, False, False], [False, True, False]]  # padding is never missing
    empty = HubTable.compute(bank, [])
    bias, missing = empty.lookup(np.array([[3, -1]]))
    assert bias.tolist() == [[0.0, 0.0]] and missing.tolist() == [[True, False]]


def test_a_table_is_written_whole_and_read_back_only_for_its_size(tmp_path):
    rng = np.random.default_rng(1)
    bank = small_bank(rng)
    table = HubTable.compute(bank, chunks(np.arange(30), unit_rows(rng, 30, 16), 8))
    path = tmp_path / "tables" / "t.npz"
    assert HubTable.load(path, 30) is None  # none written yet
    table.save(path)
    assert [p.name for p in path.parent.iterdir()] == ["t.npz"]  # no temporary file left
    again = HubTable.load(path, 30)
    assert again is not None
    np.testing.assert_array_equal(again.ids, table.ids)
    np.testing.assert_array_equal(again.bias, table.bias)
    assert HubTable.load(path, 31) is None  # another size: another version's, computed again
    path.write_bytes(b"not a table")
    assert HubTable.load(path, 30) is None


def test_the_key_names_version_and_bank_not_the_serving_precision():
    rng = np.random.default_rng(2)
    bank = small_bank(rng)
    moved = CaptionBank.in_memory(bank.texts, np.roll(bank.vectors, 1, axis=0))
    other_tower = CaptionBank.in_memory(bank.texts, bank.vectors, source="another tower")
    version = ("faiss", "v0001", "2026-11-28T00:00:00+00:00", 30)
    key = hub_table_key(version, bank)
    assert key == hub_table_key(version, CaptionBank.in_memory(list(bank.texts), bank.vectors.copy()))
    assert key != hub_table_key(("faiss", "v0001", "2026-11-29T00:00:00+00:00", 30), bank)  # rewritten
    assert key != hub_table_key(("milvus", "v0001", "2026-11-28T00:00:00+00:00", 30), bank)
    assert key != hub_table_key(version, moved)
    assert key != hub_table_key(version, other_tower)
    manifest = SimpleNamespace(backend="faiss", version="v0001", created_at="2026-11-28T00:00:00+00:00", count=30)
    assert hub_table_key(version_identity(manifest), bank) == key
    assert hub_table_path("/tables", key) == Path("/tables") / f"{key}.npz"


class Version:
    """A loaded index version as ``hub_table_for`` reads it, counting whole-version reads."""

    def __init__(self, ids, vectors, version="v0001"):
        self.ids, self.vectors, self.reads = ids, vectors, 0
        self.manifest = SimpleNamespace(backend="faiss", version=version, created_at="2026-11-28T00:00:00+00:00",
                                        count=len(ids))

    def __len__(self):
        return len(self.ids)

    def iter_contents(self):
        self.reads += 1
        return chunks(self.ids, self.vectors, 8)


def test_hub_table_for_computes_a_version_once_and_reads_it_back(tmp_path, caplog):
    rng = np.random.default_rng(3)
    bank = small_bank(rng)
    version = Version(np.arange(20, 45), unit_rows(rng, 25, 16))
    assert written_hub_table(tmp_path, version, bank) is None and version.reads == 0  # nothing written, nothing computed
    table, seconds = hub_table_for(tmp_path, version, bank)
    assert seconds is not None and version.reads == 1
    np.testing.assert_array_equal(written_hub_table(tmp_path, version, bank).bias, table.bias)
    np.testing.assert_allclose(table.lookup(version.ids)[0], bank.hub_bias(version.vectors), rtol=1e-5)
    written = hub_table_path(tmp_path, hub_table_key(version_identity(version.manifest), bank))
    assert written.is_file()

    again, seconds = hub_table_for(tmp_path, version, bank)
    assert seconds is None and version.reads == 1  # read back, not computed
    np.testing.assert_array_equal(again.bias, table.bias)

    grown = Version(np.arange(20, 46), unit_rows(rng, 26, 16), version="v0002")
    hub_table_for(tmp_path, grown, bank)
    assert grown.reads == 1 and len(list(written.parent.glob("*.npz"))) == 2

    class Short(Version):  # a backend that read back fewer images than the version holds
        def __len__(self):
            return 6

    with pytest.raises(ValueError, match="read back 5 images of 6"):
        hub_table_for(tmp_path, Short(np.arange(5), unit_rows(rng, 5, 16), version="v0003"), bank)

    refusing = tmp_path / "refusing"
    refusing.write_text("a file where the folder would be")
    with caplog.at_level(logging.WARNING, logger="paraseek.paraphrase.hub_table"):
        kept, seconds = hub_table_for(refusing, version, bank)
    assert seconds is not None and "hub table not written" in caplog.text
    np.testing.assert_array_equal(kept.bias, table.bias)


def test_pruning_keeps_the_newest_tables(tmp_path):
    for i in range(5):
        p = tmp_path / f"{i}.npz"
        p.write_bytes(b"x")
        os.utime(p, (1000 + i, 1000 + i))
    (tmp_path / "notes.txt").write_text("kept")
    prune_hub_tables(tmp_path, keep=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["3.npz", "4.npz", "notes.txt"]
