from __future__ import annotations

import numpy  # noqa: F401  # loads numpy's OpenBLAS
import faiss  # noqa: F401  # loads faiss' OpenMP OpenBLAS
from threadpoolctl import threadpool_info

from core.cpu_threads import limit_pthread_blas


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
