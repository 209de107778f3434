"""Thread pools of native libraries: their size in a serving process, and a process's share of the cores.

numpy's OpenBLAS runs its own pthreads pool, whose idle threads spin for a while after every matrix
product. A server's numpy products are small (a caption-bank lookup, a re-rank of candidates), and
the spinning thread holds a core the next encoder call needs. OpenMP builds of BLAS (faiss' own)
follow the OpenMP thread settings instead and are left alone.
"""

from __future__ import annotations

import os


def limit_pthread_blas(threads: int = 1):
    """Cap every pthreads-threaded BLAS loaded in this process (numpy's OpenBLAS) at ``threads``; returns
    threadpoolctl's limiter (``restore_original_limits()`` undoes it). threadpoolctl comes with the
    serve extra, imported here only when a server starts.
    Measured on the embedded default, 2 cores, requests alternating between servers in blocks of 40:
    bank-expanded search p50 19.1 -> 17.5 ms (and 19.0 -> 17.1 with OPENBLAS_NUM_THREADS=1)."""
    from threadpoolctl import ThreadpoolController

    return ThreadpoolController().select(threading_layer="pthreads").limit(limits=threads)


def openmp_thread_share() -> int | None:
    """The thread count ``OMP_NUM_THREADS`` gives this process, or None where it is unset or not a
    positive integer. onnxruntime does not read the variable; encoders take it as their default, so
    processes that share a machine (test workers, jobs on one node) do not each spin a thread per core."""
    try:
        threads = int(os.environ.get("OMP_NUM_THREADS", ""))
    except ValueError:
        return None
    return threads if threads > 0 else None
