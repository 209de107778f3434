from __future__ import annotations

import numpy  # noqa: F401  # loads numpy's OpenBLAS
import faiss  # noqa: F401  # loads faiss' OpenMP OpenBLAS
from threadpoolctl import threadpool_info

import pytest

from paraseek.core.cpu_threads import limit_pthread_blas, openmp_thread_share


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


def test_encoders_default_to_the_openmp_share_and_explicit_threads_win(starter_bundle, monkeypatch):
    from paraseek.core.encoder import Encoder

    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    enc = Encoder(starter_bundle, load_image=False)
    assert enc.threads == 1 and enc._text_session.get_session_options().intra_op_num_threads == 1
    assert Encoder(starter_bundle, load_image=False, threads=2).threads == 2
    monkeypatch.delenv("OMP_NUM_THREADS")
    enc = Encoder(starter_bundle, load_image=False)
    assert enc.threads is None and enc._text_session.get_session_options().intra_op_num_threads == 0
