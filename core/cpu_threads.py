"""Native math libraries: their thread pools in a serving process, a process's share of the cores,
and the BLAS kernel faiss runs on.

numpy's OpenBLAS runs its own pthreads pool, whose idle threads spin for a while after every matrix
product. A server's numpy products are small (a caption-bank lookup, a re-rank of candidates), and
the spinning thread holds a core the next encoder call needs. OpenMP builds of BLAS (faiss' own)
follow the OpenMP thread settings instead and are left alone.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from types import ModuleType


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


@dataclass(frozen=True)
class CpuInfo:
    vendor: str  # GenuineIntel, AuthenticAMD, ... ("" where /proc/cpuinfo says nothing)
    model: str  # the model name
    flags: frozenset[str]


def cpu_info(cpuinfo: str | None = None) -> CpuInfo:
    """Vendor, model name and feature flags of the first CPU in /proc/cpuinfo (or the text given)."""
    if cpuinfo is None:
        try:
            with open("/proc/cpuinfo") as f:
                cpuinfo = f.read()
        except OSError:
            cpuinfo = ""
    found: dict[str, str] = {}
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key in ("vendor_id", "model name", "flags", "Features") and key not in found:
            found[key] = value.strip()
    return CpuInfo(found.get("vendor_id", ""), found.get("model name", ""),
                   frozenset((found.get("flags") or found.get("Features") or "").split()))


# faiss' wheels bundle OpenBLAS 0.3.15 (2021), which picks its kernel from a table of CPU models: on
# Intel models newer than it (Sapphire and Emerald Rapids, Granite Rapids) it falls back to its generic
# SSE3 kernel ("Prescott"). Every merged flat search multiplies with it: on an Emerald Rapids, 2 cores,
# 100K x 384, 64 queries: 721 queries/s on Prescott, 2,136 on SkylakeX (bench_blas_kernel). Intel's
# AVX-512 models that 0.3.15 does know all get SkylakeX (Cooper Lake its superset, whose additions are
# bf16 products faiss does not use), its AVX2 ones Haswell; AMD's Zen table reaches Zen 4, so AMD is
# left to it.
_AVX512 = frozenset({"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512cd"})


def faiss_openblas_kernel(info: CpuInfo | None = None) -> str | None:
    """The OpenBLAS kernel (``OPENBLAS_CORETYPE``) faiss' OpenBLAS should run on this CPU, or None to
    leave the choice to OpenBLAS."""
    info = info or cpu_info()
    if info.vendor != "GenuineIntel":
        return None
    if _AVX512 <= info.flags:
        return "SkylakeX"
    if {"avx2", "fma"} <= info.flags:
        return "Haswell"
    return None


def import_faiss() -> ModuleType:
    """faiss, its OpenBLAS loaded on ``faiss_openblas_kernel()`` unless ``OPENBLAS_CORETYPE`` is set
    (a kernel's name; empty: OpenBLAS's own detection). OpenBLAS reads the variable once, when it
    loads: call this before anything imports faiss. numpy is loaded first and the variable put back as
    it was, so numpy's newer OpenBLAS and child processes keep their own detection."""
    if "faiss" in sys.modules:
        return sys.modules["faiss"]
    import numpy  # noqa: F401

    user = os.environ.get("OPENBLAS_CORETYPE")
    # faiss' OpenBLAS (0.3.15) reads an empty value as an unknown core and falls back to Prescott, the
    # slowest kernel: empty means its own detection, so it loads without the variable
    kernel = faiss_openblas_kernel() if user is None else (user or None)
    if kernel is None:
        os.environ.pop("OPENBLAS_CORETYPE", None)
    else:
        os.environ["OPENBLAS_CORETYPE"] = kernel
    try:
        import faiss
    finally:
        if user is None:
            os.environ.pop("OPENBLAS_CORETYPE", None)
        else:
            os.environ["OPENBLAS_CORETYPE"] = user
    return faiss


def blas_kernels() -> dict[str, str]:
    """The kernel each loaded OpenBLAS runs on, by library path (threadpoolctl's report)."""
    from threadpoolctl import threadpool_info

    return {i["filepath"]: str(i.get("architecture")) for i in threadpool_info() if i.get("internal_api") == "openblas"}


def faiss_blas_kernel() -> str | None:
    """The kernel faiss' own OpenBLAS (in faiss_cpu.libs/) runs on; None before faiss is loaded."""
    return next((kernel for path, kernel in blas_kernels().items() if "faiss" in path), None)
