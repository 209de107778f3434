"""A snapshot's metadata.jsonl read in place: line offsets, lookups by id, and rows that disagree."""

import json

import numpy as np
import pytest

from paraseek.index import metadata_file
from paraseek.index.faiss_index import IdRows
from paraseek.index.metadata_file import MetadataFile, MetadataRowError, line_starts


pytestmark = pytest.mark.quick


def write_rows(path, ids, trailing_newline=True):
    text = "\n".join(json.dumps({"id": int(i), "caption": f"photo {i}", "fields": {"n": int(i) % 3}}) for i in ids)
    path.write_text(text + ("\n" if trailing_newline else ""))


@pytest.mark.parametrize("window", [3, 7, 1 << 20])
def test_line_starts_across_scan_windows(monkeypatch, window):
    monkeypatch.setattr(metadata_file, "SCAN_BYTES", window)
    text = b'{"a": 1}\n{"bb": 22}\n\xc3\xa9\n'
    assert line_starts(text).tolist() == [0, 9, 20, 23]
    assert line_starts(text[:-1]).tolist() == [0, 9, 20, 22]  # a last line without its newline counts
    assert line_starts(b"").tolist() == [0]


@pytest.mark.parametrize("ids", [np.arange(100, 140), np.array([7, 3, 99, 12, 5000, 1])])
def test_rows_are_found_by_id_in_ids_order(tmp_path, ids):
    path = tmp_path / "metadata.jsonl"
    write_rows(path, ids)
    meta = MetadataFile(path, ids)
    assert len(meta) == len(ids) and list(meta) == ids.tolist()
    for i in ids:
        assert meta[int(i)] == {"id": int(i), "caption": f"photo {i}", "fields": {"n": int(i) % 3}}
        assert int(i) in meta
    assert [row["id"] for row in meta.values()] == ids.tolist()
    assert [row["id"] for row in meta.rows(1, 3)] == ids[1:3].tolist()
    assert 424242 not in meta and "x" not in meta
    with pytest.raises(KeyError):
        meta[424242]
    assert meta.get(424242) is None


def test_no_trailing_newline_and_an_empty_file(tmp_path):
    path = tmp_path / "metadata.jsonl"
    write_rows(path, [5, 6], trailing_newline=False)
    assert MetadataFile(path, np.array([5, 6]))[6]["id"] == 6
    path.write_text("")
    empty = MetadataFile(path, np.zeros(0, np.int64))
    assert len(empty) == 0 and list(empty.values()) == [] and 1 not in empty


def test_rows_that_disagree_with_the_ids_are_refused(tmp_path):
    path = tmp_path / "metadata.jsonl"
    write_rows(path, [1, 2, 3])
    with pytest.raises(MetadataRowError, match="3 rows, ids.npy 4"):
        MetadataFile(path, np.array([1, 2, 3, 4]))
    swapped = MetadataFile(path, np.array([1, 3, 2]))
    with pytest.raises(MetadataRowError, match="row 1 is not the row of id 3"):
        swapped[3]


def test_id_rows_by_arithmetic_or_sorted_lookup():
    consecutive = IdRows(np.arange(10, 20))
    assert consecutive._first == 10  # no sorted copy kept for consecutive ids
    rows, found = consecutive.lookup([10, 19, 20, 9, -1])
    assert rows.tolist()[:2] == [0, 9] and found.tolist() == [True, True, False, False, False]
    scattered = IdRows(np.array([40, 10, 30, 20]))
    assert scattered._first is None
    assert scattered.rows([20, 40, 10]).tolist() == [3, 0, 1]
    with pytest.raises(KeyError, match=r"\[25\]"):
        scattered.rows([20, 25])
    rows, found = IdRows(np.zeros(0, np.int64)).lookup([1])
    assert found.tolist() == [False]


def test_rows_with_values_only_pythons_json_writes_are_read(tmp_path):
    """json.dumps writes NaN and Infinity (a parquet column with gaps); they read back as floats."""
    path = tmp_path / "metadata.jsonl"
    path.write_text(json.dumps({"id": 1, "fields": {"score": float("nan"), "peak": float("inf")}}) + "\n")
    fields = MetadataFile(path, np.array([1]))[1]["fields"]
    assert np.isnan(fields["score"]) and fields["peak"] == float("inf")
