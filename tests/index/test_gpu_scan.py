"""Exact search through onnxruntime (the GPU path for flat snapshots where faiss has no kernels for the
card), run here on onnxruntime's CPU provider: the same graph, the same answers as faiss' flat index."""

import logging

import faiss
import numpy as np
import pytest

from paraseek.index import gpu_scan
from paraseek.index.gpu_scan import SCAN_MODEL, ExactScan, exact_scan_for, scan_model
from paraseek.index.snapshot import FaissStore, Snapshot
from tests.index.test_memory_mapped import build, clustered


pytestmark = pytest.mark.quick


def test_the_shipped_graph_is_the_one_scan_model_writes():
    assert SCAN_MODEL.read_bytes() == scan_model()


def test_scan_answers_as_faiss_flat():
    rows, queries = clustered(3000, 48), clustered(17, 48, seed=3)
    flat = faiss.IndexFlatIP(48)
    flat.add(rows)
    scan = ExactScan(rows, "CPUExecutionProvider")
    assert not scan.on_gpu
    for q, k in [(queries, 10), (queries[:1], 1), (queries[:4], 100)]:
        scores, positions = scan.search(q, k)
        want_scores, want_positions = flat.search(q, k)
        np.testing.assert_array_equal(positions, want_positions)
        np.testing.assert_allclose(scores, want_scores, rtol=1e-5, atol=1e-6)
    assert scan.search(queries[:2], 5000)[1].shape == (2, 3000)  # k past the collection: all of it, ranked
    # a batch whose scores would pass the bound runs in several calls, with the same answers
    small = ExactScan(rows, "CPUExecutionProvider", max_scores=3000 * 4)
    assert small.queries_per_call == 4
    np.testing.assert_array_equal(small.search(queries, 10)[1], flat.search(queries, 10)[1])
    with pytest.raises(ValueError, match="query dim 8 != 48"):
        scan.search(np.ones((1, 8), np.float32), 3)


def test_no_scan_without_rows_or_a_gpu_or_when_told_not_to(monkeypatch):
    rows = clustered(100, 8)
    assert exact_scan_for(None) is None
    monkeypatch.setattr(gpu_scan, "gpu_provider", lambda: None)  # an onnxruntime without a CUDA provider
    assert exact_scan_for(rows) is None
    monkeypatch.setattr(gpu_scan, "gpu_provider", lambda: "CPUExecutionProvider")
    assert exact_scan_for(rows, use_gpu=False) is None
    assert isinstance(exact_scan_for(rows), ExactScan)


# onnxruntime warns of the asked-for CUDA provider it lacks: the very case under test
@pytest.mark.filterwarnings("ignore:Specified provider 'CUDAExecutionProvider' is not in available provider names")
def test_a_scan_that_fails_to_start_leaves_the_cpu_searching(monkeypatch, caplog):
    monkeypatch.setattr(gpu_scan, "gpu_provider", lambda: "CUDAExecutionProvider")  # listed, but no device here
    with caplog.at_level(logging.WARNING, logger="paraseek.index.gpu_scan"):
        assert exact_scan_for(clustered(100, 8)) is None
    assert "searching on CPU" in caplog.text


def test_a_flat_snapshot_searches_through_the_scan_where_one_starts(tmp_path, monkeypatch):
    root = build(tmp_path, "flat", n=2000)
    monkeypatch.setattr(gpu_scan, "gpu_provider", lambda: None)  # as on a host without a GPU provider
    plain = Snapshot.load(root)
    monkeypatch.setattr(gpu_scan, "gpu_provider", lambda: "CPUExecutionProvider")
    scanned = FaissStore(root).load()
    assert plain._scan is None and scanned._scan is not None
    calls = []
    search = scanned._scan.search
    monkeypatch.setattr(scanned._scan, "search", lambda q, k: calls.append(len(q)) or search(q, k))
    queries = clustered(9, 32, seed=2)
    for q in (queries, queries[:1]):
        scores, ids = scanned.search_ids(q, 10)
        want_scores, want_ids = plain.search_ids(q, 10)
        np.testing.assert_array_equal(ids, want_ids)
        np.testing.assert_allclose(scores, want_scores, rtol=1e-5, atol=1e-6)
    assert calls == [9, 1]
    # told to stay on the CPU (PARASEEK_PROVIDERS=cpu), and approximate indexes: no scan
    assert FaissStore(root).load(use_gpu=False)._scan is None
    (tmp_path / "ivf").mkdir()
    assert Snapshot.load(build(tmp_path / "ivf", "ivf_flat"))._scan is None
