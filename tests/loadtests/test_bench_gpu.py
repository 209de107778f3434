"""bench_gpu on a machine without a GPU: the CPU rows of every precision the bundle holds, the index
rows with recall, and a plain statement that there is nothing to compare."""

from __future__ import annotations

import shutil

import pytest
from typer.testing import CliRunner

from paraseek.cli import app
from paraseek.loadtests import bench_gpu


def test_cpu_rows_for_each_precision_and_the_index(starter_bundle, shared_data, tmp_path, capsys):
    bundle = tmp_path / "starter"
    shutil.copytree(starter_bundle, bundle)
    assert CliRunner().invoke(app, ["models", "fp16", str(bundle)]).exit_code == 0
    assert bench_gpu.main(["--bundle", str(bundle), "--sizes", "3000", "--budget-s", "0.05", "--batches", "1", "8", "--data", str(shared_data)]) == 0
    out = capsys.readouterr().out
    rows = [line.split() for line in out.splitlines() if line.startswith("CPU ")]
    assert [r[2] for r in rows] == ["fp32", "fp16", "int8"]
    for r in rows:
        assert r[1] == "CPU" and float(r[3]) > 0  # ran on CPU, b1 ms
        assert float(r[-1]) >= (0.999 if r[2] != "int8" else 0.95)  # min cosine to fp32 on CPU
    fp32 = next(r for r in rows if r[2] == "fp32")
    assert float(fp32[-1]) > 0.99999  # the reference against itself
    index = {line.split()[1]: line.split() for line in out.splitlines() if line.strip().startswith("3000 ")}
    assert set(index) == {"flat", "ivf_flat"} and float(index["flat"][-1]) == 1.0
    assert 0.5 <= float(index["ivf_flat"][-1]) <= 1.0
    # a host with a GPU adds its rows and their ratios to the CPU's; one without says there are none
    from paraseek.core.encoder import GPU_PROVIDERS, choose_providers
    from paraseek.index.faiss_index import gpu_count

    gpu_providers = [p.removesuffix("ExecutionProvider") for p in choose_providers() if p in GPU_PROVIDERS]
    encoder_ratios = [line for line in out.splitlines() if line.startswith("encoder ") and " / CPU " in line]
    assert [line.split()[1] for line in encoder_ratios] == [p for p in gpu_providers for _ in rows]
    if not gpu_providers and gpu_count() == 0:
        assert "no GPU rows: nothing to compare (CPU only here)" in out
    else:
        assert "no GPU rows" not in out and any(line.startswith("search ") for line in out.splitlines()) == bool(
            gpu_count() or gpu_providers)


@pytest.mark.quick
def test_ratios_compare_the_same_precision_and_index():
    enc = [{"provider": "CUDA", "precision": "fp16", "b1_ms": 1.0, "b256_per_s": 5000.0},
           {"provider": "CPU", "precision": "fp16", "b1_ms": 2.0, "b256_per_s": 500.0},
           {"provider": "CPU", "precision": "int8", "b1_ms": 1.5, "b256_per_s": 800.0}]
    idx = [{"size": 10, "index": "flat", "device": "cpu", "b1_ms": 4.0, "b64_per_s": 100.0},
           {"size": 10, "index": "flat", "device": "gpu", "b1_ms": 1.0, "b64_per_s": 1000.0},
           {"size": 10, "index": "flat", "device": "gpu-onnxruntime", "b1_ms": 0.5, "b64_per_s": 400.0}]
    assert bench_gpu.ratios(enc, idx) == [
        "encoder CUDA fp16 / CPU fp16: batch 1 2.0x faster, batch 256 10.0x the texts/s",
        "search flat 10 gpu / cpu: batch 1 4.0x faster, batch 64 10.0x the queries/s",
        "search flat 10 gpu-onnxruntime / cpu: batch 1 8.0x faster, batch 64 4.0x the queries/s"]
