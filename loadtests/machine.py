"""Which machine a benchmark ran on, in one line: runs on different CPUs differ by more than most
changes do (the request path's ratio to its ceiling was 0.99 on a Zen 1 and 0.74 on an AVX-512 VNNI
EPYC), so every benchmark prints it with its numbers."""

from __future__ import annotations

import os
import platform

# the instruction sets that change what onnxruntime's int8 kernels and faiss' scans run on
SIMD_FLAGS = ("avx2", "fma", "avx512f", "avx512_vnni", "avx512_bf16", "avx_vnni", "amx_int8", "amx_bf16", "sha_ni")


def cpu_description(cpuinfo: str | None = None) -> str:
    """'MODEL, N cores, SIMD: flags' from /proc/cpuinfo (or the text given); elsewhere the platform's name."""
    if cpuinfo is None:
        try:
            with open("/proc/cpuinfo") as f:
                cpuinfo = f.read()
        except OSError:
            cpuinfo = ""
    model, flags = platform.processor() or platform.machine(), set()
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key == "model name":
            model = value.strip()
        elif key in ("flags", "Features"):
            flags = set(value.split())
    simd = [f for f in SIMD_FLAGS if f in flags]
    return f"{model}, {os.cpu_count()} cores, SIMD: {' '.join(simd) or 'none of ' + '/'.join(SIMD_FLAGS[:3])}"
