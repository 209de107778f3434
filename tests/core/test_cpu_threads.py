from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy  # noqa: F401  # loads numpy's OpenBLAS
import psutil
import faiss  # noqa: F401  # loads faiss' OpenMP OpenBLAS
from threadpoolctl import threadpool_info

import pytest

from paraseek.core.cpu_threads import cpu_info, faiss_openblas_kernel, limit_pthread_blas, openmp_thread_share


pytestmark = pytest.mark.quick


def _blas_threads() -> dict[str, int]:
    return {i["filepath"]: i["num_threads"] for i in threadpool_info() if i["user_api"] == "blas"}


def test_pthreads_blas_is_capped_and_openmp_blas_left_alone():
    pthreads = {i["filepath"] for i in threadpool_info() if i.get("threading_layer") == "pthreads"}
    assert pthreads, "numpy's OpenBLAS (pthreads) should be loaded"
    before = _blas_threads()
    limiter = limit_pthread_blas()
    try:
        during = _blas_threads()
        assert all(during[f] == 1 for f in pthreads)
        assert all(during[f] == n for f, n in before.items() if f not in pthreads)
    finally:
        limiter.restore_original_limits()
    assert _blas_threads() == before


@pytest.mark.parametrize(("value", "share"), [("3", 3), ("1", 1), ("0", None), ("-2", None), ("two", None), ("", None)])
def test_openmp_thread_share_reads_a_positive_count(monkeypatch, value, share):
    monkeypatch.setenv("OMP_NUM_THREADS", value)
    assert openmp_thread_share() == share


def _threads_started_by(make) -> int:
    """How many threads this process gained while ``make()`` ran (the object it made is kept alive)."""
    before = len(os.listdir("/proc/self/task"))
    made = make()
    started = len(os.listdir("/proc/self/task")) - before
    del made
    return started


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts threads through /proc")
def test_encoders_default_to_the_openmp_share_and_explicit_threads_win(starter_bundle, monkeypatch):
    """An onnxruntime session on n threads starts a pool of n - 1 (the caller's thread is the n-th)."""
    from paraseek.core.encoder import Encoder

    Encoder(starter_bundle, load_image=False)  # onnxruntime's process-wide threads, started once
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    assert Encoder(starter_bundle, load_image=False).threads == 1
    assert _threads_started_by(lambda: Encoder(starter_bundle, load_image=False)) == 0
    assert _threads_started_by(lambda: Encoder(starter_bundle, load_image=False, threads=3)) == 2  # explicit wins
    monkeypatch.delenv("OMP_NUM_THREADS")
    assert Encoder(starter_bundle, load_image=False).threads is None  # onnxruntime's own choice: a thread per physical core
    pool = _threads_started_by(lambda: Encoder(starter_bundle, load_image=False))
    physical = psutil.cpu_count(logical=False) or 1
    assert min(1, physical - 1) <= pool <= (os.cpu_count() or 1) - 1  # a pool wherever there is a second core


INTEL_AVX512 = "vendor_id : GenuineIntel\nmodel name : Xeon\nflags : fpu sse2 avx2 fma avx512f avx512bw avx512vl avx512dq avx512cd\n"
INTEL_AVX2 = "vendor_id : GenuineIntel\nmodel name : Core\nflags : fpu sse2 avx2 fma\n"
AMD_AVX512 = "vendor_id : AuthenticAMD\nmodel name : EPYC\nflags : fpu sse2 avx2 fma avx512f avx512bw avx512vl avx512dq avx512cd\n"


@pytest.mark.parametrize(("cpuinfo", "kernel"), [
    (INTEL_AVX512, "SkylakeX"), (INTEL_AVX2, "Haswell"), (INTEL_AVX512.replace(" avx512cd", ""), "Haswell"),
    ("vendor_id : GenuineIntel\nflags : fpu sse2 sse3\n", None), (AMD_AVX512, None), ("", None),
])
def test_faiss_openblas_kernel_by_cpu(cpuinfo, kernel):
    assert faiss_openblas_kernel(cpu_info(cpuinfo)) == kernel


def test_cpu_info_reads_the_first_cpu():
    info = cpu_info(INTEL_AVX2 + "\nvendor_id : Other\nflags : none\n")
    assert (info.vendor, info.model) == ("GenuineIntel", "Core") and {"avx2", "fma"} <= info.flags


def _kernels_in_fresh_process(env: dict[str, str], load: str = "import_faiss()") -> dict:
    """OpenBLAS kernels by library path and OPENBLAS_CORETYPE, in a fresh process that ran ``load``."""
    code = ("import json, os; from paraseek.core.cpu_threads import blas_kernels, import_faiss; "
            f"{load}; print(json.dumps({{'kernels': blas_kernels(), 'env': os.environ.get('OPENBLAS_CORETYPE')}}))")
    clean = {k: v for k, v in os.environ.items() if k != "OPENBLAS_CORETYPE"}
    out = subprocess.run([sys.executable, "-c", code], env={**clean, **env}, capture_output=True, text=True, check=True)
    return json.loads(out.stdout)


def _faiss_kernel(got: dict) -> list[str]:
    return [kernel for path, kernel in got["kernels"].items() if "faiss" in path]


def test_import_faiss_puts_faiss_openblas_on_the_chosen_kernel_and_leaves_numpy_and_the_environment():
    got = _kernels_in_fresh_process({})
    assert len(_faiss_kernel(got)) == 1 and got["env"] is None  # the variable is gone again
    chosen = faiss_openblas_kernel()  # None (AMD, older Intel): OpenBLAS's own detection, as faiss alone gets
    own = _faiss_kernel(_kernels_in_fresh_process({}, load="import faiss"))
    assert _faiss_kernel(got) == ([chosen] if chosen is not None else own)
    numpy_alone = _kernels_in_fresh_process({}, load="import numpy")["kernels"]
    assert {p: k for p, k in got["kernels"].items() if "faiss" not in p} == numpy_alone  # numpy's own detection


def test_import_faiss_respects_a_kernel_the_user_set_and_an_empty_value_is_openblas_own_choice():
    got = _kernels_in_fresh_process({"OPENBLAS_CORETYPE": "Prescott"})
    assert _faiss_kernel(got) == ["Prescott"] and got["env"] == "Prescott"
    own = _kernels_in_fresh_process({}, load="import faiss")
    empty = _kernels_in_fresh_process({"OPENBLAS_CORETYPE": ""})
    # faiss' OpenBLAS alone would read "" as an unknown core (Prescott); the variable is left as it was
    assert _faiss_kernel(empty) == _faiss_kernel(own) and empty["env"] == ""


def test_faiss_blas_kernel_names_the_kernel_of_faiss_own_openblas():
    from paraseek.core.cpu_threads import blas_kernels, faiss_blas_kernel

    kernel = faiss_blas_kernel()  # faiss is loaded by this module's imports
    assert kernel is not None and kernel in {k for path, k in blas_kernels().items() if "faiss_cpu.libs" in path}
