"""faiss' OpenBLAS kernel side by side: OpenBLAS's own choice against the one paraseek picks for this CPU
(``core.cpu_threads.faiss_openblas_kernel``), or any kernels named. The kernel is fixed when faiss loads,
so each is measured in processes of its own: merged flat searches (batches of 1-64 queries, medians, in
a fresh process per kernel), then two servers side by side at concurrency 32, runs alternating.

    python -m paraseek.loadtests.research.bench_blas_kernel --work W [--kernels openblas paraseek] [--rounds 3]

``openblas`` is OpenBLAS's own detection (``OPENBLAS_CORETYPE`` empty), ``paraseek`` the default (unset);
any other name is passed on as ``OPENBLAS_CORETYPE``."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from paraseek.core.settings import Settings
from paraseek.loadtests import DEFAULT_DATA, temporary_folder
from paraseek.loadtests.bench_service import drive, prepare_bundle, prepare_snapshot, synthetic_space
from paraseek.loadtests.machine import cpu_description
from paraseek.loadtests.queries import caption_groups
from paraseek.loadtests.server import start_server, stop_server
from paraseek.training.embedded import ensure_embedded_default

BATCHES = (1, 8, 32, 64)


def kernel_env(kernel: str) -> dict[str, str]:
    """What to add to this process's environment to load faiss on ``kernel`` (``paraseek``: nothing)."""
    return {} if kernel == "paraseek" else {"OPENBLAS_CORETYPE": "" if kernel == "openblas" else kernel}


def measure_index(root: Path, data: Path, budget_s: float) -> dict:
    """In this process: faiss' kernel and queries/s of the snapshot's search at each batch size, on every core."""
    from paraseek.core.cpu_threads import faiss_blas_kernel
    from paraseek.index.faiss_index import set_threads
    from paraseek.index.snapshot import Snapshot

    snap = Snapshot.load(root, verify=False)
    queries = synthetic_space(snap.manifest.dim, data)[1]
    set_threads(os.cpu_count())
    rates = {}
    for batch in BATCHES:
        q = queries[:batch]
        snap.search_ids(q, 10)
        times: list[float] = []
        stop = time.perf_counter() + budget_s
        while time.perf_counter() < stop or len(times) < 5:
            start = time.perf_counter()
            snap.search_ids(q, 10)
            times.append(time.perf_counter() - start)
        rates[batch] = batch / statistics.median(times)
    return {"kernel": faiss_blas_kernel() or "unknown", "rates": rates}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--kernels", nargs="+", default=["openblas", "paraseek"])
    p.add_argument("--size", type=int, default=100_000, help="flat snapshot of the robust starter's space")
    p.add_argument("--work", type=Path, default=None, help="where the bundle and snapshot are built (reused)")
    p.add_argument("--rounds", type=int, default=3, help="alternating rounds of each measurement; medians")
    p.add_argument("--seconds", type=float, default=5.0, help="length of each concurrency-32 run")
    p.add_argument("--data", type=Path, default=DEFAULT_DATA)
    p.add_argument("--measure-index", type=Path, default=None, help=argparse.SUPPRESS)  # one kernel's process
    args = p.parse_args(argv)
    if args.measure_index is not None:
        print(json.dumps(measure_index(args.measure_index, args.data, budget_s=1.0)))
        return 0
    if "OPENBLAS_CORETYPE" in os.environ:
        p.error("unset OPENBLAS_CORETYPE: this benchmark sets it for each kernel's processes")

    work = args.work or temporary_folder("paraseek-bench-blas-")
    home = work / "home"
    ensure_embedded_default(Settings(home=home))
    bundle = prepare_bundle("starter", home, work)
    root = prepare_snapshot(bundle, args.size, work, args.data)
    print(f"faiss' OpenBLAS kernel, side by side, {args.size:,}-image flat snapshot, {args.rounds} alternating rounds, "
          f"medians; {cpu_description()}", flush=True)

    index: dict[str, list[dict]] = {k: [] for k in args.kernels}
    for _ in range(args.rounds):
        for kernel in args.kernels:
            out = subprocess.run([sys.executable, "-m", "paraseek.loadtests.research.bench_blas_kernel", "--measure-index", str(root),
                                  "--data", str(args.data)], env={**os.environ, **kernel_env(kernel)}, capture_output=True,
                                 text=True, check=True)
            index[kernel].append(json.loads(out.stdout.strip().splitlines()[-1]))
    print(f"{'kernel':10} {'loads':10} " + " ".join(f"{'b' + str(b) + ' q/s':>9}" for b in BATCHES))
    medians: dict[str, dict[int, float]] = {}
    for kernel, runs in index.items():
        medians[kernel] = {b: statistics.median(r["rates"][str(b)] for r in runs) for b in BATCHES}
        print(f"{kernel:10} {runs[0]['kernel']:10} " + " ".join(f"{medians[kernel][b]:9.0f}" for b in BATCHES))

    # bench_service's requests: a training caption numbered like the collection's rows
    groups = caption_groups(args.data / "coco-captions" / "train_captions.tsv", min_size=4)

    def plain(i: int) -> dict:
        return {"query": f"{groups[i % len(groups)][0]} ({90_000_000 + i})", "k": 10, "expansion": {"method": "none"}}

    servers = {}
    try:
        for kernel in args.kernels:
            servers[kernel] = start_server({
                **kernel_env(kernel), "PARASEEK_HOME": str(home), "PARASEEK_LOG_JSON": "false", "PARASEEK_BUNDLE": str(bundle),
                "PARASEEK_SNAPSHOT": str(root), "PARASEEK_PRECISION": "int8", "PARASEEK_LRU_SIZE": "0"}, timeout=300)
        load: dict[str, list[dict]] = {k: [] for k in args.kernels}
        offset = iter(range(1, 10**6))
        for _ in range(args.rounds):
            for kernel, (_, url) in servers.items():
                base = next(offset) * 1_000_000
                load[kernel].append(asyncio.run(drive(url, lambda i, b=base: plain(i + b), 32, args.seconds)))
    finally:
        for proc, _ in servers.values():
            stop_server(proc)
    print(f"\n{'kernel':10} {'req/s c32':>10} {'p50 ms':>8} {'p99 ms':>8}")
    qps = {}
    for kernel, runs in load.items():
        qps[kernel] = statistics.median(r["qps"] for r in runs)
        print(f"{kernel:10} {qps[kernel]:10.1f} {statistics.median(r['p50'] for r in runs):8.2f} "
              f"{statistics.median(r['p99'] for r in runs):8.2f}")
    first, *others = args.kernels
    for kernel in others:
        print(f"{kernel} / {first}: b64 search x{medians[kernel][64] / medians[first][64]:.2f}, "
              f"service at concurrency 32 x{qps[kernel] / qps[first]:.2f}")
    failures = sum(r["failures"] for runs in load.values() for r in runs)
    return 0 if failures == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
