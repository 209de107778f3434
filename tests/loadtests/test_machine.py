"""The machine line every benchmark prints."""

import os

import pytest

from paraseek.loadtests.machine import cpu_description

pytestmark = pytest.mark.quick


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

    from paraseek.index import faiss_index
    from paraseek.loadtests.machine import gpu_description

    monkeypatch.setattr(shutil, "which", lambda name: None)  # a host without NVIDIA's driver tools
    monkeypatch.setattr(faiss_index, "gpu_count", lambda: 0)  # and a faiss that sees no GPU
    line = gpu_description()
    assert line.startswith("GPUs: no nvidia-smi; ")
    assert f"onnxruntime {ort.__version__} providers: " in line and "CPU" in line
    assert line.endswith("faiss GPUs: 0")
    monkeypatch.setattr(faiss_index, "gpu_count", lambda: 2)
    monkeypatch.setattr(faiss_index, "gpu_search_works", lambda: False)
    assert gpu_description().endswith("faiss GPUs: 2 (a search on them fails: CPU)")


def test_cpu_clock_counts_a_process_that_computes_and_not_one_that_sleeps():
    import subprocess
    import sys

    from paraseek.loadtests.machine import cpu_clock

    # each says when it has started (its start-up falls before the first reading); the first then
    # computes 0.5 s of CPU once told to and says so; both then wait
    spin = subprocess.Popen([sys.executable, "-c", "import sys, time\nprint('ready', flush=True)\nsys.stdin.readline()\n"
                             "end = time.process_time() + 0.5\nwhile time.process_time() < end: pass\n"
                             "print('done', flush=True)\nsys.stdin.readline()"],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    sleep = subprocess.Popen([sys.executable, "-c", "import sys\nprint('ready', flush=True)\nsys.stdin.readline()"],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert spin.stdout.readline().strip() == "ready" and sleep.stdout.readline().strip() == "ready"
        start_spin, start_sleep = cpu_clock(spin.pid), cpu_clock(sleep.pid)
        spin.stdin.write("go\n"), spin.stdin.flush()
        assert spin.stdout.readline().strip() == "done"
        end_spin, end_sleep = cpu_clock(spin.pid), cpu_clock(sleep.pid)
    finally:
        spin.kill(), sleep.kill(), spin.wait(), sleep.wait()
    spun = end_spin.process_s - start_spin.process_s
    assert 0.45 <= spun <= 0.7
    assert end_sleep.process_s - start_sleep.process_s <= 0.03
    assert end_spin.machine_s - start_spin.machine_s >= spun - 0.05  # the machine was busy at least that long
    assert end_spin.wall_s - start_spin.wall_s >= 0.45


def test_cpu_clock_of_a_process_that_is_gone_is_nan():
    import math

    from paraseek.loadtests.machine import cpu_clock

    assert math.isnan(cpu_clock(2**22 + 12345).process_s)


def test_cpu_share_per_request_and_busy_cores():
    import math

    from paraseek.loadtests.machine import CpuClock, cpu_share

    use = cpu_share(CpuClock(10.0, 100.0, 50.0), CpuClock(13.0, 107.0, 54.0), requests_per_s=250.0)
    # 3 CPU seconds over 4 s at 250 requests/s: 0.75 cores, 3 ms a request; 7 busy seconds over 4 s
    assert math.isclose(use["server_cpu_ms"], 3.0) and math.isclose(use["busy_cores"], 1.75)
    assert math.isnan(cpu_share(CpuClock(1, 1, 5.0), CpuClock(2, 2, 5.0), 100.0)["server_cpu_ms"])
