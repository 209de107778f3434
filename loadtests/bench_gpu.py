"""The text tower and the index on every device this machine offers, side by side in one run.

Encoder: each execution provider onnxruntime can run here (TensorRT, CUDA, CPU) at each precision the
bundle holds (fp32, fp16, int8): median milliseconds of one caption, texts/s at batch 32 and 256, and
the cosine of its embeddings to fp32 on CPU (the reference every other row is held to). Index: exact
(flat) and IVF search of ``--sizes`` synthetic vectors in the bundle's dimension (bench_index's
caption-like mix), batch 1 and 64, on all CPU cores and, where faiss sees GPUs, on them; IVF's
recall@10 against exact. The ratios (GPU over CPU) are measured in this run, on this machine.

    python -m paraseek.loadtests.bench_gpu --bundle DIR [--sizes 1000000] [--data ../shared/data]

With no GPU it still runs (CPU rows only), which is how its test runs it.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path
from typing import Any

import numpy as np

from paraseek.core.bundle import read_manifest
from paraseek.core.demo import demo_captions
from paraseek.core.encoder import GPU_PROVIDERS, Encoder, choose_providers
from paraseek.loadtests import DEFAULT_DATA
from paraseek.loadtests.machine import cpu_description, gpu_description

BATCHES = (1, 32, 256)


def median_seconds(fn, budget_s: float, min_calls: int = 5) -> float:
    fn()  # warm-up (a GPU provider allocates and tunes on its first call of a shape)
    times: list[float] = []
    start = time.perf_counter()
    while time.perf_counter() - start < budget_s or len(times) < min_calls:
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def encoder_rows(bundle: Path, texts: list[str], budget_s: float, batches: tuple[int, ...] = BATCHES) -> list[dict]:
    """One row per (provider, precision): b1 ms, texts/s per batch size, cosine to fp32 on CPU."""
    m = read_manifest(bundle)
    precisions = ["fp32"] + [p for p, spec in (("fp16", m.text_fp16), ("int8", m.text_int8)) if spec is not None]
    reference = Encoder(bundle, precision="fp32", load_image=False, providers=["CPUExecutionProvider"]).encode_text(texts)
    rows = []
    for provider in [p for p in choose_providers() if p in GPU_PROVIDERS] + ["CPUExecutionProvider"]:
        providers = [provider] if provider == "CPUExecutionProvider" else [provider, "CPUExecutionProvider"]
        for precision in precisions:
            enc = Encoder(bundle, precision=precision, load_image=False, providers=providers, threads=os.cpu_count())
            ran_on = enc.text_providers[0]
            got = enc.encode_text(texts)
            cos = np.sum(got * reference, axis=1)
            row = {"provider": provider.removesuffix("ExecutionProvider"), "ran_on": ran_on.removesuffix("ExecutionProvider"),
                   "precision": precision, "cos_min": float(cos.min()), "cos_mean": float(cos.mean())}
            for batch in batches:
                step = iter(range(10**9))

                def call(batch=batch, step=step, enc=enc):
                    start = next(step) * batch
                    enc.encode_text([texts[(start + j) % len(texts)] for j in range(batch)], batch_size=batch)

                seconds = median_seconds(call, budget_s)
                row[f"b{batch}_ms"] = seconds * 1000
                row[f"b{batch}_per_s"] = batch / seconds
            rows.append(row)
            print(f"{row['provider']:9} {row['ran_on']:9} {precision:5} {row['b1_ms']:8.2f} "
                  + " ".join(f"{row[f'b{b}_per_s']:9.0f}" for b in batches[1:])
                  + f" {row['cos_mean']:.6f} {row['cos_min']:.6f}", flush=True)
    return rows


def index_rows(dim: int, sizes: list[int], data: Path, budget_s: float) -> list[dict]:
    """Flat and IVF (nlist 4 sqrt(n), nprobe 32) at each size, on CPU and on faiss' GPUs where it sees any;
    flat also as onnxruntime's exact scan on the GPU (``index.gpu_scan``) where onnxruntime has CUDA."""
    from paraseek.index.faiss_index import IndexSpec, apply_search_params, create_index, gpu_count, set_threads, to_search_device
    from paraseek.index.gpu_scan import ExactScan, gpu_provider
    from paraseek.loadtests.bench_index import synthetic_collection
    from paraseek.loadtests.bench_service import synthetic_space

    set_threads(os.cpu_count())
    centres, queries = synthetic_space(dim, data)
    rows = []
    for n in sizes:
        vectors = synthetic_collection(centres, n, np.random.default_rng(n))
        ids = np.arange(n, dtype=np.int64)
        truth = None
        nlist = int(4 * np.sqrt(n))
        for kind, spec in (("flat", IndexSpec(type="flat")), ("ivf_flat", IndexSpec(type="ivf_flat", nlist=nlist, nprobe=32))):
            cpu = create_index(spec, dim)
            if not cpu.is_trained:  # 40 points a list: above faiss' 39 and a few seconds of k-means at 1M
                cpu.train(vectors[: min(n, 40 * nlist)])
            cpu.add_with_ids(vectors, ids)
            apply_search_params(cpu, spec)
            devices: list[tuple[str, Any]] = [("cpu", cpu)]  # each with search(queries, k)
            if gpu_count() > 0:
                gpu, where = to_search_device(cpu, spec, use_gpu=True)
                if where == "gpu":
                    devices.append(("gpu", gpu))
            provider = gpu_provider()
            if kind == "flat" and provider is not None:  # what a flat snapshot serves where faiss cannot use the GPU
                devices.append(("gpu-onnxruntime", ExactScan(vectors, provider)))
            for device, index in devices:
                found = index.search(queries, 10)[1]
                if kind == "flat" and device == "cpu":
                    truth = found
                recall = float(np.mean([len(set(a) & set(b)) / 10 for a, b in zip(found, truth)])) if truth is not None else None
                row = {"size": n, "index": kind, "device": device, "recall_at_10": recall}
                for batch in (1, 64):
                    step = iter(range(10**9))

                    def call(batch=batch, step=step, index=index):
                        start = next(step) * batch % (len(queries) - batch)
                        index.search(queries[start : start + batch], 10)

                    seconds = median_seconds(call, budget_s)
                    row[f"b{batch}_ms"], row[f"b{batch}_per_s"] = seconds * 1000, batch / seconds
                rows.append(row)
                print(f"{n:>10} {kind:9} {device:15} {row['b1_ms']:9.3f} {row['b64_per_s']:10.0f} "
                      f"{'' if recall is None else f'{recall:.3f}'}", flush=True)
        del vectors
    return rows


def ratios(enc: list[dict], idx: list[dict]) -> list[str]:
    """GPU over CPU, same precision (encoder) or same index (search), from this run's rows."""
    lines = []
    cpu = {r["precision"]: r for r in enc if r["provider"] == "CPU"}
    for r in enc:
        if r["provider"] != "CPU" and r["precision"] in cpu:
            c = cpu[r["precision"]]
            top = max(int(k[1:-6]) for k in r if k.startswith("b") and k.endswith("_per_s"))
            lines.append(f"encoder {r['provider']} {r['precision']} / CPU {r['precision']}: batch 1 "
                         f"{c['b1_ms'] / r['b1_ms']:.1f}x faster, batch {top} "
                         f"{r[f'b{top}_per_s'] / c[f'b{top}_per_s']:.1f}x the texts/s")
    cpu_idx = {(r["size"], r["index"]): r for r in idx if r["device"] == "cpu"}
    for r in idx:
        if r["device"] != "cpu":
            c = cpu_idx[(r["size"], r["index"])]
            lines.append(f"search {r['index']} {r['size']} {r['device']} / cpu: batch 1 {c['b1_ms'] / r['b1_ms']:.1f}x faster, "
                         f"batch 64 {r['b64_per_s'] / c['b64_per_s']:.1f}x the queries/s")
    return lines


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--bundle", type=Path, required=True)
    p.add_argument("--sizes", type=int, nargs="*", default=[1_000_000], help="index sizes (none: encoder rows only)")
    p.add_argument("--data", type=Path, default=DEFAULT_DATA)
    p.add_argument("--budget-s", type=float, default=2.0, help="seconds of timed calls per cell (medians)")
    p.add_argument("--batches", type=int, nargs="+", default=list(BATCHES), help="encoder batch sizes (the first: 1)")
    args = p.parse_args(argv)
    if args.batches[0] != 1:
        p.error("--batches: the first must be 1 (the batch-1 latency column)")
    manifest = read_manifest(args.bundle)
    print(f"machine: {cpu_description()}\naccelerators: {gpu_description()}", flush=True)
    # texts like bench_service's requests: a caption and a number
    texts = [f"{c} ({90_000_000 + i})" for i, c in enumerate(demo_captions() * 4)][:512]
    print(f"\nencoder {manifest.name}: {'provider':9} {'ran on':9} {'prec':5} {'b1 ms':>8} "
          + " ".join(f"{f'b{b} /s':>9}" for b in args.batches[1:]) + " cos-to-fp32-CPU mean/min", flush=True)
    enc = encoder_rows(args.bundle, texts, args.budget_s, tuple(args.batches))
    idx: list[dict] = []
    if args.sizes:
        print(f"\nindex ({manifest.embedding_dim}-d): {'size':>10} {'index':9} {'dev':4} {'b1 ms':>9} {'b64 q/s':>10} recall@10", flush=True)
        idx = index_rows(manifest.embedding_dim, args.sizes, args.data, args.budget_s)
    print()
    for line in ratios(enc, idx) or ["no GPU rows: nothing to compare (CPU only here)"]:
        print(line)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
