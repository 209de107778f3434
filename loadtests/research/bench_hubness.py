"""What hub correction (``hub_weight``) costs on a large collection: the robust starter serving a synthetic
collection of ``--size`` images (bench_service's caption-like mix in the starter's space) with the embedded
default's expansion, against the same expansion at ``hub_weight`` 0, distinct captions (no cache hits),
alternating in each round; medians over the rounds. This checkout's server reads each image's hubness from
the index version's hub table, built on a thread at start (its build time is reported; the rows are measured
after it is built); ``--before DIR`` runs a checkout of an older commit beside it under the same load, which
computes hubness per image the first time a list shows it. Then the table as ``paraseek index build`` and
``paraseek index hub-table`` write it, before a server loads the version: its time there, and how long after
the server answered ``/readyz`` each way of getting it left lists corrected per image (``/v1/info``).

    python -m paraseek.loadtests.research.bench_hubness --data ../shared/data [--size 100000] [--before /tmp/before]
        [--bundle B --bank DIR]
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

from paraseek.core.bundle import read_manifest
from paraseek.core.settings import Settings
from paraseek.loadtests import DEFAULT_DATA, temporary_folder
from paraseek.loadtests.bench_service import drive, prepare_snapshot, round_medians, start_paraseek
from paraseek.loadtests.machine import cpu_description
from paraseek.loadtests.queries import caption_groups
from paraseek.loadtests.server import start_server, stop_server
from paraseek.training.embedded import EMBEDDED_DEFAULT_EXPANSION

DEFAULT = json.loads(EMBEDDED_DEFAULT_EXPANSION["robust"])
CONFIGS = {"default": DEFAULT, "default, hub_weight 0": {**DEFAULT, "hub_weight": 0}}


def wait_for_table(folder: Path, since: float, timeout: float) -> float | None:
    """Seconds from ``since`` until a hub table written after it is in ``folder``, or None by ``timeout``."""
    while time.time() < since + timeout:
        written = [p.stat().st_mtime for p in folder.glob("*.npz")] if folder.is_dir() else []
        if any(t >= since for t in written):
            return max(written) - since
        time.sleep(0.5)
    return None


def table_after_ready(url: str, timeout: float) -> float | None:
    """Seconds from now (a server that has just answered ``/readyz``) until ``/v1/info`` says its version's hub
    table is ready; None if it failed or did not come by ``timeout``."""
    began = time.time()
    while time.time() < began + timeout:
        state = httpx.get(f"{url}/v1/info", timeout=10).json()["snapshot"]["hub_table"]
        if state == "ready":
            return time.time() - began
        if state == "failed":
            return None
        time.sleep(0.1)
    return None


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data", type=Path, default=DEFAULT_DATA)
    p.add_argument("--size", type=int, default=100_000, help="images in the synthetic collection")
    p.add_argument("--work", type=Path, default=None, help="home and snapshot folder (default: a new temporary one)")
    p.add_argument("--before", type=Path, default=None, help="a checkout of an older commit to measure beside this one")
    p.add_argument("--seconds", type=float, default=5.0, help="per configuration, round and concurrency")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    p.add_argument("--bundle", type=Path, default=None,
                   help="serve this bundle (default: the embedded robust starter, built by a first start)")
    p.add_argument("--bank", type=Path, default=None, help="its caption bank (default: the bundle's default bank)")
    p.add_argument("--table-timeout", type=float, default=600.0, help="seconds to wait for the hub table")
    args = p.parse_args(argv)
    texts = [c for g in caption_groups(args.data / "coco-captions/train_captions.tsv") for c in g]
    work = args.work or temporary_folder("paraseek-bench-hubness-")
    home = work / "home"
    bundle = args.bundle
    if bundle is None:
        # the embedded default's first start: both starters and the robust bank (minutes on a busy machine)
        proc, _ = start_server({"PARASEEK_HOME": str(home), "PARASEEK_LOG_JSON": "false"}, timeout=600)
        stop_server(proc, 10)
        bundle = Settings(home=home).bundle_dir
    root = prepare_snapshot(bundle, args.size, work, args.data, index="flat")
    env = {"PARASEEK_BUNDLE": bundle, "PARASEEK_SNAPSHOT": root, "PARASEEK_DEFAULT_EXPANSION": json.dumps(DEFAULT),
           **({"PARASEEK_CAPTION_BANK": args.bank} if args.bank else {})}

    tables = Settings(home=home).hub_tables_dir  # where the servers and `index hub-table` keep them
    servers = {"this checkout": None, **({"before": args.before} if args.before else {})}
    results: dict[tuple[str, str, int], list[dict]] = {}
    built: float | None = None
    for label, checkout in servers.items():
        shutil.rmtree(tables, ignore_errors=True)  # built anew: its build time is reported
        started = time.time()
        proc, url = start_paraseek(home, checkout, **env)
        try:
            if checkout is None:
                behind = table_after_ready(url, args.table_timeout)
                built = wait_for_table(tables, started, args.table_timeout)
                if built is None or behind is None:
                    print(f"no hub table within {args.table_timeout:.0f} s")
                    return 1
            for round_ in range(args.rounds):
                for conc in args.concurrency:
                    for index, (name, expansion) in enumerate(CONFIGS.items()):
                        offset = ((round_ * 100 + conc) * len(CONFIGS) + index) * 1_000_000  # distinct texts per row

                        def body(i: int, offset=offset, expansion=expansion) -> dict:
                            return {"query": f"{texts[i % len(texts)]} ({offset + i})", "k": 10, "expansion": expansion}

                        results.setdefault((label, name, conc), []).append(asyncio.run(drive(url, body, conc, args.seconds)))
        finally:
            stop_server(proc, 10)

    # the table written beforehand, as `paraseek index build` does before it publishes a version
    shutil.rmtree(tables, ignore_errors=True)
    began = time.time()
    subprocess.run([sys.executable, "-m", "paraseek.cli", "index", "hub-table", str(root)], check=True,
                   env={**os.environ, "PARASEEK_HOME": str(home), **{k: str(v) for k, v in env.items()}})
    written = time.time() - began
    proc, url = start_paraseek(home, None, **env)
    try:
        behind_written = table_after_ready(url, args.table_timeout)
    finally:
        stop_server(proc, 10)

    print(f"\nhub correction on {args.size:,} images (flat index, {read_manifest(bundle, verify=False).name}, the robust "
          f"starter's default expansion), "
          f"{args.rounds} rounds x {args.seconds:.0f} s, loopback; {cpu_description()}")
    print(f"this checkout's hub table: written {built:.1f} s after the server was started, ready {behind:.1f} s after "
          f"it answered /readyz (lists corrected per image meanwhile)")
    print(f"written beforehand by `paraseek index hub-table` in {written:.1f} s (process start included): ready "
          + (f"{behind_written:.1f} s after /readyz" if behind_written is not None else "never (failed)"))
    width = max(len(f"{label}: {name}") for label in servers for name in CONFIGS)
    print(f"{'server: expansion':{width}} {'conc':>4} {'p50 ms':>8} {'p99 ms':>8} {'req/s':>8} {'p50 / hub 0':>12} {'fail':>5}")
    failures = 0
    for label in servers:
        for conc in args.concurrency:
            base = round_medians(results[(label, "default, hub_weight 0", conc)])[0]
            for name in CONFIGS:
                p50, p99, qps, fail = round_medians(results[(label, name, conc)])
                failures += fail
                print(f"{label + ': ' + name:{width}} {conc:>4} {p50:8.2f} {p99:8.2f} {qps:8.1f} {p50 / base:12.2f} {fail:>5}")
    return 0 if failures == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
