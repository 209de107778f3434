"""Which machine a benchmark ran on, in one line: runs on different CPUs differ by more than most
changes do (the request path's ratio to its ceiling was 0.99 on a Zen 1 and 0.74 on an AVX-512 VNNI
EPYC), so every benchmark prints it with its numbers."""

from __future__ import annotations

import math
import os
import platform
import time
from dataclasses import dataclass

from paraseek.core.cpu_threads import cpu_info, faiss_blas_kernel, import_faiss

# the instruction sets that change what onnxruntime's int8 kernels and faiss' scans run on
SIMD_FLAGS = ("avx2", "fma", "avx512f", "avx512_vnni", "avx512_bf16", "avx_vnni", "amx_int8", "amx_bf16", "sha_ni")


def cpu_description(cpuinfo: str | None = None) -> str:
    """'MODEL, N cores, SIMD: flags' from /proc/cpuinfo (or the text given); elsewhere the platform's
    name. For this machine (no text given) also the kernel faiss' OpenBLAS runs on."""
    info = cpu_info(cpuinfo)
    model = info.model or platform.processor() or platform.machine()
    simd = [f for f in SIMD_FLAGS if f in info.flags]
    line = f"{model}, {os.cpu_count()} cores, SIMD: {' '.join(simd) or 'none of ' + '/'.join(SIMD_FLAGS[:3])}"
    if cpuinfo is None:
        import_faiss()
        line += f", faiss BLAS kernel: {faiss_blas_kernel() or 'unknown'}"
    return line


def gpu_description() -> str:
    """The accelerators a benchmark may use, in one line: the GPUs nvidia-smi lists (name, memory,
    driver), the execution providers onnxruntime offers and the GPUs faiss sees."""
    import shutil
    import subprocess

    import onnxruntime as ort

    from paraseek.index.faiss_index import gpu_count, gpu_search_works

    gpus = "no nvidia-smi"
    if shutil.which("nvidia-smi"):
        out = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30)
        gpus = "; ".join(line.strip() for line in out.stdout.splitlines() if line.strip()) or "none listed"
    providers = [p.removesuffix("ExecutionProvider") for p in ort.get_available_providers()]
    faiss_gpus = gpu_count()
    searchable = "" if not faiss_gpus else " (searches on them work)" if gpu_search_works() else " (a search on them fails: CPU)"
    return (f"GPUs: {gpus}; onnxruntime {ort.__version__} providers: {', '.join(providers)}; "
            f"faiss GPUs: {faiss_gpus}{searchable}")


@dataclass(frozen=True)
class CpuClock:
    """CPU seconds used so far by one process (all its threads) and by the whole machine (every core,
    user, system and interrupt time: not idle, I/O wait or time the hypervisor gave to another guest),
    and the wall clock they were read at: two readings around a load test say how much of the cores
    the server took per request and how busy the machine was."""

    process_s: float
    machine_s: float
    wall_s: float


def cpu_clock(pid: int | str = "self") -> CpuClock:
    """``CpuClock`` now, from /proc (Linux); NaN where it cannot be read."""
    tick = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    process = machine = math.nan
    try:
        with open(f"/proc/{pid}/stat") as f:
            # fields after the command name, which may hold spaces: utime and stime are the 12th and 13th
            fields = f.read().rpartition(")")[2].split()
        process = (int(fields[11]) + int(fields[12])) / tick
        with open("/proc/stat") as f:
            cpu = [int(v) for v in f.readline().split()[1:]]
        machine = (sum(cpu[:3]) + cpu[5] + cpu[6]) / tick  # user, nice, system, irq, softirq
    except (OSError, ValueError, IndexError):
        pass
    return CpuClock(process, machine, time.monotonic())


def cpu_share(before: CpuClock, after: CpuClock, requests_per_s: float) -> dict[str, float]:
    """Between two readings of a server process: its CPU ms per request (all cores) and the cores the
    whole machine kept busy (server, load generator and anything else)."""
    wall = after.wall_s - before.wall_s
    if wall <= 0 or requests_per_s <= 0:
        return {"server_cpu_ms": math.nan, "busy_cores": math.nan}
    return {"server_cpu_ms": (after.process_s - before.process_s) / wall / requests_per_s * 1000,
            "busy_cores": (after.machine_s - before.machine_s) / wall}
