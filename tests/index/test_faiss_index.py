"""GPU placement of a FAISS index: a GPU that FAISS sees but cannot search on (faiss aborts the process
there) leaves the index on CPU."""

import logging

import faiss
import numpy as np
import pytest

from paraseek.index import faiss_index
from paraseek.index.faiss_index import IndexSpec, gpu_search_works, to_search_device


pytestmark = pytest.mark.quick


@pytest.fixture
def one_fake_gpu(monkeypatch):
    """FAISS reports one GPU; placing an index on it hands back the index marked as moved."""
    moved = []

    def to_gpus(index):
        moved.append(index)
        return index

    monkeypatch.setattr(faiss_index, "gpu_count", lambda: 1)
    monkeypatch.setattr(faiss, "index_cpu_to_all_gpus", to_gpus)
    gpu_search_works.cache_clear()
    yield moved
    gpu_search_works.cache_clear()


def flat_index() -> faiss.Index:
    index = faiss.IndexFlatIP(4)
    index.add(np.eye(4, dtype=np.float32))
    return index


def test_a_gpu_whose_test_search_aborts_keeps_the_index_on_cpu(one_fake_gpu, monkeypatch, caplog):
    # what faiss does where its build has no kernels for the GPU: an assertion, then abort()
    monkeypatch.setattr(faiss_index, "GPU_PROBE", "import os, sys; sys.stderr.write('CUDA error 209\\n'); os.abort()")
    index = flat_index()
    with caplog.at_level(logging.WARNING, logger="paraseek.index.faiss_index"):
        placed, device = to_search_device(index, IndexSpec(type="flat"), use_gpu=True)
    assert (placed, device) == (index, "cpu")
    assert one_fake_gpu == []
    assert "CUDA error 209" in caplog.text and "searching on CPU" in caplog.text


def test_a_gpu_whose_test_search_works_gets_the_index(one_fake_gpu, monkeypatch):
    monkeypatch.setattr(faiss_index, "GPU_PROBE", "pass")
    index = flat_index()
    placed, device = to_search_device(index, IndexSpec(type="flat"), use_gpu=True)
    assert device == "gpu" and one_fake_gpu == [index]


def test_the_test_search_runs_once_per_process(one_fake_gpu, monkeypatch, tmp_path):
    runs = tmp_path / "runs"
    monkeypatch.setattr(faiss_index, "GPU_PROBE", f"open({str(runs)!r}, 'a').write('x')")
    for _ in range(3):
        to_search_device(flat_index(), IndexSpec(type="flat"), use_gpu=True)
    assert runs.read_text() == "x"


def test_no_gpu_wanted_or_hnsw_runs_no_test_search(one_fake_gpu, monkeypatch):
    monkeypatch.setattr(faiss_index, "GPU_PROBE", "raise SystemExit('must not run')")
    assert to_search_device(flat_index(), IndexSpec(type="flat"), use_gpu=False)[1] == "cpu"
    assert to_search_device(flat_index(), IndexSpec(type="hnsw"), use_gpu=True)[1] == "cpu"
    assert gpu_search_works.cache_info().currsize == 0


@pytest.mark.skipif(faiss_index.gpu_count() > 0, reason="this faiss build sees GPUs")
def test_the_real_probe_fails_cleanly_without_gpus():
    # a CPU build of faiss has no index_cpu_to_all_gpus that works: the child fails, this process lives
    gpu_search_works.cache_clear()
    try:
        assert gpu_search_works() is False
    finally:
        gpu_search_works.cache_clear()
