"""The machine line every benchmark prints."""

import os

from paraseek.loadtests.machine import cpu_description

CPUINFO = """processor\t: 0
model name\t: AMD EPYC 9654 96-Core Processor
flags\t\t: fpu sse2 avx2 fma avx512f avx512_vnni sha_ni
processor\t: 1
model name\t: AMD EPYC 9654 96-Core Processor
flags\t\t: fpu sse2 avx2 fma avx512f avx512_vnni sha_ni
"""


def test_model_cores_and_the_simd_flags_that_matter():
    line = cpu_description(CPUINFO)
    assert line == f"AMD EPYC 9654 96-Core Processor, {os.cpu_count()} cores, SIMD: avx2 fma avx512f avx512_vnni sha_ni"


def test_a_cpu_without_them_says_so():
    assert cpu_description("model name : Old\nflags : fpu sse2\n").endswith("SIMD: none of avx2/fma/avx512f")


def test_this_machine_is_described():
    line = cpu_description()
    assert "cores, SIMD:" in line and "faiss BLAS kernel: " in line and not line.endswith("unknown")


def test_the_accelerator_line_names_providers_and_faiss_gpus(monkeypatch):
    import shutil

    import onnxruntime as ort

    from paraseek.loadtests.machine import gpu_description

    monkeypatch.setattr(shutil, "which", lambda name: None)  # a host without NVIDIA's driver tools
    line = gpu_description()
    assert line.startswith("GPUs: no nvidia-smi; ")
    assert f"onnxruntime {ort.__version__} providers: " in line and "CPU" in line
    assert line.endswith("faiss GPUs: 0")
