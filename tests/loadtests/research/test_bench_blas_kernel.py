"""loadtests/research/bench_blas_kernel.py: each kernel's process loads faiss on that kernel and measures its searches."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from paraseek.index.builder import build_snapshot_from_vectors
from paraseek.index.faiss_index import IndexSpec
from paraseek.loadtests.research import bench_blas_kernel


@pytest.mark.quick
def test_kernel_env_names_what_each_kernel_sets():
    assert bench_blas_kernel.kernel_env("paraseek") == {}  # unset: paraseek's choice
    assert bench_blas_kernel.kernel_env("openblas") == {"OPENBLAS_CORETYPE": ""}  # OpenBLAS's own detection
    assert bench_blas_kernel.kernel_env("Haswell") == {"OPENBLAS_CORETYPE": "Haswell"}


def test_a_kernel_process_loads_faiss_on_its_kernel_and_rates_every_batch(shared_data, tmp_path):
    rng = np.random.default_rng(0)
    vectors = rng.standard_normal((5_000, 512)).astype(np.float32)
    np.save(tmp_path / "vectors.npy", vectors / np.linalg.norm(vectors, axis=1, keepdims=True))
    build_snapshot_from_vectors(tmp_path / "vectors.npy", tmp_path / "snap", image_space="test/space",
                                spec=IndexSpec(type="flat"), progress=False)
    env = {k: v for k, v in os.environ.items() if k != "OPENBLAS_CORETYPE"}
    out = subprocess.run([sys.executable, "-m", "paraseek.loadtests.research.bench_blas_kernel", "--measure-index",
                          str(tmp_path / "snap"), "--data", str(shared_data)],
                         env={**env, **bench_blas_kernel.kernel_env("Prescott")}, capture_output=True, text=True, check=True)
    measured = json.loads(out.stdout.strip().splitlines()[-1])
    assert measured["kernel"] == "Prescott"
    assert sorted(int(b) for b in measured["rates"]) == list(bench_blas_kernel.BATCHES)
    assert all(rate > 0 for rate in measured["rates"].values())


@pytest.mark.quick
def test_the_benchmark_refuses_a_kernel_set_outside_it(monkeypatch):
    monkeypatch.setenv("OPENBLAS_CORETYPE", "Haswell")
    with pytest.raises(SystemExit):
        bench_blas_kernel.main(["--work", "unused"])
