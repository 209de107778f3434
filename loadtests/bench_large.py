"""Bigger than memory, one run: a collection of ``--count`` (10M) x ``--dim`` (384) vectors built by
``paraseek index build --embeddings`` with the defaults (``--type auto``, tuned to recall@10 0.95 on
caption-like query vectors), then served by ``paraseek serve`` on the robust starter with the index
memory-mapped.

Prints the build's time, disk use and peak memory (RSS, and its private part: RSS less file-backed
pages), the server's start time, private and file-backed memory after start, after the first query
and after the load, the cold-cache first query (the version's files dropped from the page cache
first), recall@10 (held-out queries, from the build) and p50/p99 at concurrency 1 and 32, with
targets: private memory under ``--max-private-gb`` (2), p50 at concurrency 1 under ``--max-p50-ms``
(25), recall >= 0.95.

The vectors are bench_index's synthetic mix carried into ``--dim`` (bench_service.synthetic_space).
``--work`` keeps shards and snapshot for the next run (the 10M build takes most of an hour on 2
cores); a rerun serves what is there. The same at 200K with a small memory budget runs in the
default test suite (tests/loadtests/test_bench_large.py).

    python -m paraseek.loadtests.bench_large [--count 10000000] [--dim 384] [--work DIR] [--seconds 15]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import httpx
import numpy as np

from paraseek.core.bundle import read_manifest
from paraseek.core.memory import MemorySampler, process_memory
from paraseek.core.settings import Settings
from paraseek.loadtests import DEFAULT_DATA, temporary_folder
from paraseek.loadtests.bench_index import write_synthetic_shards
from paraseek.loadtests.bench_service import drive, start_paraseek, synthetic_space
from paraseek.loadtests.machine import cpu_description
from paraseek.loadtests.queries import caption_groups
from paraseek.loadtests.server import stop_server
from paraseek.training.embedded import ensure_embedded_default

SHARD_ROWS = 1_000_000


def write_shards(folder: Path, count: int, dim: int, data: Path) -> None:
    """``count`` synthetic vectors in .npy shards of SHARD_ROWS, and 500 caption-like query vectors
    beside the folder (``queries.npy``), in the same ``dim``-dimensional space."""
    centres, queries = synthetic_space(dim, data)
    write_synthetic_shards(folder, count, SHARD_ROWS, centres)
    np.save(folder.parent / "queries.npy", queries)


def folder_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def drop_from_page_cache(folder: Path) -> None:
    """Ask the kernel to drop the cached pages of every file under ``folder`` (those no process has
    mapped in: a server's touched index pages stay), so the next reads come from the disk."""
    for path in folder.rglob("*"):
        if path.is_file():
            fd = os.open(path, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def build(args, work: Path, image_space: str) -> dict:
    """Build once into ``work/snapshot`` (a child process, sampled for memory); its numbers are kept in
    ``work/build.json`` for later runs."""
    record = work / "build.json"
    if record.is_file():
        return json.loads(record.read_text())
    shards = work / "shards"
    if not (shards / "emb_0000.npy").is_file():
        started = time.perf_counter()
        # a child writes them: this process stays small, so the build's peak is its own
        subprocess.run([sys.executable, "-c", "import sys; from pathlib import Path; from paraseek.loadtests.bench_large "
                        "import write_shards; write_shards(Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), "
                        "Path(sys.argv[4]))", str(shards), str(args.count), str(args.dim), str(args.data)], check=True)
        print(f"wrote {args.count:,} x {args.dim} vectors in {time.perf_counter() - started:.0f} s", flush=True)
    snapshot = work / "snapshot"
    shutil.rmtree(snapshot, ignore_errors=True)
    cmd = [sys.executable, "-m", "paraseek.cli", "index", "build", "--embeddings", str(shards), "--image-space", image_space,
           "--query-vectors", str(work / "queries.npy"), "--out", str(snapshot)]
    if args.params:
        cmd += ["--params", args.params]
    if args.type:  # a type named is not tuned unless asked (``auto`` is): ask for the recall checked below
        cmd += ["--type", args.type, "--target-recall", str(args.target_recall)]
    print("$ paraseek " + " ".join(cmd[3:]), flush=True)
    started = time.perf_counter()
    proc = subprocess.Popen(cmd, env={**os.environ, "PARASEEK_LOG_JSON": "false"})
    with MemorySampler(proc.pid, interval=0.5) as memory:
        code = proc.wait()
    if code != 0:
        raise SystemExit(f"the build failed with exit code {code}")
    version = next((snapshot / "versions").iterdir())
    manifest = json.loads((version / "manifest.json").read_text())
    result = {"seconds": time.perf_counter() - started, "peak_rss_mb": memory.peak_rss, "peak_private_mb": memory.peak_private,
              "shards_bytes": folder_bytes(shards), "version_bytes": folder_bytes(version),
              "files": {p.name: p.stat().st_size for p in sorted(version.iterdir()) if p.is_file()},
              "index": manifest["index"], "recall_at_10": manifest["recall_at_10"], "recall_queries": manifest["recall_queries"],
              "tuning": manifest["tuning"], "count": manifest["count"], "dim": manifest["dim"]}
    record.write_text(json.dumps(result, indent=2))
    return result


def memory_line(label: str, pid: int) -> dict:
    m = process_memory(pid)
    print(f"  {label:34} RSS {m.rss_mb:8.0f} MB   private {m.private_mb:8.0f} MB   file-backed {m.file_mb:8.0f} MB", flush=True)
    return {"rss_mb": m.rss_mb, "private_mb": m.private_mb, "file_mb": m.file_mb}


def serve(args, work: Path, home: Path, bundle: Path, groups: list[list[str]]) -> dict:
    def body(i: int) -> dict:
        return {"query": f"{groups[i % len(groups)][0]} ({i})", "k": 10, "expansion": {"method": "none"}}

    snapshot = work / "snapshot"
    # a start that hashes every file, then the default start: only files changed since their last
    # verification are hashed (none, since the build recorded them and the one before re-verified)
    drop_from_page_cache(snapshot)
    started = time.perf_counter()
    proc, url = start_paraseek(home, PARASEEK_SNAPSHOT=snapshot, PARASEEK_BUNDLE=bundle, PARASEEK_SNAPSHOT_VERIFY="always")
    out: dict = {"start_rehash_s": time.perf_counter() - started}
    stop_server(proc)
    drop_from_page_cache(snapshot)
    started = time.perf_counter()
    proc, url = start_paraseek(home, PARASEEK_SNAPSHOT=snapshot, PARASEEK_BUNDLE=bundle)
    out["start_s"] = time.perf_counter() - started
    try:
        print(f"\nserving {snapshot} (ready in {out['start_s']:.1f} s, files unchanged since their last sha256 check; "
              f"{out['start_rehash_s']:.1f} s hashing every file, PARASEEK_SNAPSHOT_VERIFY=always)", flush=True)
        out["memory_ready"] = memory_line("ready", proc.pid)
        drop_from_page_cache(snapshot)  # make the first query cold
        with httpx.Client(base_url=url, timeout=120) as client:
            t0 = time.perf_counter()
            first = client.post("/v1/search", json=body(10**8))
            out["cold_first_query_ms"] = (time.perf_counter() - t0) * 1000
            first.raise_for_status()
            t0 = time.perf_counter()
            client.post("/v1/search", json=body(10**8 + 1)).raise_for_status()
            out["second_query_ms"] = (time.perf_counter() - t0) * 1000
            out["info"] = client.get("/v1/info").json()["snapshot"]
        print(f"  cold first query {out['cold_first_query_ms']:.0f} ms, the next {out['second_query_ms']:.0f} ms", flush=True)
        out["memory_first_query"] = memory_line("after the first query", proc.pid)
        counter = iter(range(2 * 10**8, 3 * 10**8))
        asyncio.run(drive(url, lambda _: body(next(counter)), 4, args.warmup_seconds))
        with MemorySampler(proc.pid) as sampled:
            for concurrency in (1, 32):
                row = asyncio.run(drive(url, lambda _: body(next(counter)), concurrency, args.seconds))
                out[f"c{concurrency}"] = row
                print(f"  concurrency {concurrency:>2}: p50 {row['p50']:7.2f} ms   p99 {row['p99']:7.2f} ms   "
                      f"{row['qps']:7.1f} requests/s   failures {row['failures']}", flush=True)
        out["memory_loaded"] = memory_line("after the load", proc.pid)
        out["peak_private_mb"], out["peak_rss_mb"] = sampled.peak_private, sampled.peak_rss
        print(f"  {'peak during the load':34} RSS {sampled.peak_rss:8.0f} MB   private {sampled.peak_private:8.0f} MB")
    finally:
        stop_server(proc, 30)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--count", type=int, default=10_000_000)
    p.add_argument("--dim", type=int, default=384, help="the served bundle's (the starters': 384)")
    p.add_argument("--work", type=Path, default=None, help="keeps shards, snapshot and build.json for later runs")
    p.add_argument("--home", type=Path, default=None, help="PARASEEK_HOME with the embedded default (built if missing)")
    p.add_argument("--bundle", type=Path, default=None, help="serve this bundle (default: the embedded default's robust starter)")
    p.add_argument("--params", default=None, help="index build --params (default: none, as a user would build)")
    p.add_argument("--type", default=None, help="index build --type (default: none, auto, as a user would build)")
    p.add_argument("--seconds", type=float, default=15.0, help="duration of each concurrency's run")
    p.add_argument("--warmup-seconds", type=float, default=10.0)
    p.add_argument("--max-private-gb", type=float, default=2.0)
    p.add_argument("--max-p50-ms", type=float, default=25.0)
    p.add_argument("--target-recall", type=float, default=0.95)
    p.add_argument("--build-only", action="store_true", help="stop after the build (serve it in a later run)")
    p.add_argument("--out", type=Path, default=None, help="write every number as JSON here")
    p.add_argument("--data", type=Path, default=DEFAULT_DATA)
    args = p.parse_args(argv)
    print(f"machine: {cpu_description()}", flush=True)
    work = args.work or temporary_folder("paraseek-bench-large-")
    work.mkdir(parents=True, exist_ok=True)
    home = args.home or work / "home"
    bundle = args.bundle
    if bundle is None:
        bundle, _ = ensure_embedded_default(Settings(home=home), progress=False, with_bank=False)
    manifest = read_manifest(bundle, verify=False)
    if manifest.embedding_dim != args.dim:
        p.error(f"--dim {args.dim}: the bundle {bundle} embeds in {manifest.embedding_dim} dimensions")
    built = build(args, work, manifest.image_space)
    files = ", ".join(f"{name} {size / 2**30:.2f} GB" for name, size in built["files"].items() if size > 2**20)
    print(f"\nbuild of {built['count']:,} x {built['dim']}: {built['seconds'] / 60:.1f} min, index {built['index']['type']} "
          f"(nlist {built['index']['nlist']}, nprobe {built['index']['nprobe']}, refine {built['index']['refine_factor']}); "
          f"peak RSS {built['peak_rss_mb'] / 1024:.2f} GB, of it private {built['peak_private_mb'] / 1024:.2f} GB; disk: "
          f"shards {built['shards_bytes'] / 2**30:.2f} GB, version {built['version_bytes'] / 2**30:.2f} GB ({files})")
    print(f"recall@10 {built['recall_at_10']:.3f} on {built['recall_queries']} held-out caption-like queries "
          f"(tuned on {built['tuning']['tuning_queries']} others)" if built["tuning"] else f"recall@10 {built['recall_at_10']}")
    if args.build_only:
        return 0
    groups = caption_groups(args.data / "coco-captions" / "train_captions.tsv", min_size=1)
    served = serve(args, work, home, bundle, groups)
    worst_private = max(served["memory_loaded"]["private_mb"], served["peak_private_mb"])
    checks = [
        (f"private memory under {args.max_private_gb} GB", worst_private / 1024, worst_private <= args.max_private_gb * 1024),
        (f"recall@10 >= {args.target_recall}", built["recall_at_10"] or 1.0, (built["recall_at_10"] or 1.0) >= args.target_recall),
        (f"p50 at concurrency 1 under {args.max_p50_ms} ms", served["c1"]["p50"], served["c1"]["p50"] < args.max_p50_ms),
        ("no failed request", served["c1"]["failures"] + served["c32"]["failures"],
         served["c1"]["failures"] + served["c32"]["failures"] == 0),
    ]
    print()
    for text, value, ok in checks:
        print(f"{text}: {value:.3f} -> {'met' if ok else 'NOT met'}")
    if args.out:
        args.out.write_text(json.dumps({"build": built, "serve": served, "checks": [[t, v, ok] for t, v, ok in checks]},
                                       indent=2, default=float))
    return 0 if all(ok for _, _, ok in checks) else 1


if __name__ == "__main__":
    raise SystemExit(main())
