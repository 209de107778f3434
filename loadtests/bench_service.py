"""Service benchmark, one run: end-to-end latency (p50/p99) and throughput at concurrency 1 and 32
for plain search, search with a consistency report (3 paraphrases) and a cache hit, plus the
throughput ratio with micro-batching on vs off at concurrency 32. Two real servers on loopback (the
starter bundle over the demo gallery), one with batching and one without, driven side by side.

Queries are real COCO captions; each request uses a caption not sent before (no cache help), and
the consistency paraphrases are other human captions of the same photo. Load generator and server
share this machine's cores, so absolute numbers are conservative.

    python -m loadtests.bench_service [--seconds 8] [--data ../shared/data]
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import httpx

from core.settings import Settings
from loadtests.queries import caption_groups
from loadtests.server import start_server
from training.embedded import ensure_embedded_default

DEFAULT_DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data"


def start_paraseek(home: Path, **env) -> tuple[subprocess.Popen, str]:
    return start_server({"PARASEEK_HOME": str(home), "PARASEEK_LOG_JSON": "false", **{k: str(v) for k, v in env.items()}})


async def drive(url: str, make_body, concurrency: int, seconds: float) -> dict:
    latencies: list[float] = []
    failures = 0
    counter = iter(range(10**9))
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=30, limits=limits) as client:
        await client.post("/v1/search", json=make_body(next(counter)))  # warm connection
        stop = time.perf_counter() + seconds

        async def worker():
            nonlocal failures
            while time.perf_counter() < stop:
                body = make_body(next(counter))
                t0 = time.perf_counter()
                r = await client.post("/v1/search", json=body)
                latencies.append(time.perf_counter() - t0)
                if r.status_code != 200:
                    failures += 1

        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        elapsed = time.perf_counter() - start
    latencies.sort()
    return {
        "n": len(latencies), "failures": failures, "qps": len(latencies) / elapsed,
        "p50": statistics.median(latencies) * 1000,
        "p99": latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))] * 1000,
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seconds", type=float, default=8.0, help="duration of each measurement")
    p.add_argument("--data", type=Path, default=DEFAULT_DATA)
    p.add_argument("--home", type=Path, default=None, help="PARASEEK_HOME with the embedded default (built if missing)")
    args = p.parse_args(argv)

    home = args.home or Path(tempfile.mkdtemp(prefix="paraseek-bench-service-"))
    ensure_embedded_default(Settings(home=home))
    groups = caption_groups(args.data / "coco-captions" / "train_captions.tsv", min_size=4)
    servers = {}
    try:
        for name, batching in (("batching", "true"), ("no-batching", "false")):
            servers[name] = start_paraseek(home, PARASEEK_BATCHING=batching)

        def plain(i):
            g = groups[i % len(groups)]
            return {"query": f"{g[0]} ({i})" if i >= len(groups) else g[0], "k": 10}

        def consistency(i):
            g = groups[i % len(groups)]
            suffix = f" ({i})" if i >= len(groups) else ""
            return {"query": g[0] + suffix, "k": 10, "consistency": {"paraphrases": [c + suffix for c in g[1:4]], "k": 10}}

        def cached(i):
            return {"query": "a dog playing in the park", "k": 10}

        rows = []
        url = servers["batching"][1]
        for conc in (1, 32):
            for label, fn in (("plain", plain), ("consistency-3", consistency), ("cache-hit", cached)):
                offset = {"plain": 0, "consistency-3": 50_000, "cache-hit": 0}[label] + conc * 100_000
                res = asyncio.run(drive(url, lambda i, fn=fn, o=offset: fn(i + o), conc, args.seconds))
                rows.append((label, conc, res))
        off = asyncio.run(drive(servers["no-batching"][1], lambda i: plain(i + 900_000), 32, args.seconds))
        on = next(r for lbl, c, r in rows if lbl == "plain" and c == 32)
    finally:
        for proc, _ in servers.values():
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()

    print(f"\nservice benchmark (starter bundle, demo gallery, {args.seconds:.0f} s per row, loopback)")
    print(f"{'scenario':15} {'conc':>4} {'requests':>8} {'fail':>4} {'p50 ms':>8} {'p99 ms':>8} {'req/s':>8}")
    for label, conc, r in rows:
        print(f"{label:15} {conc:>4} {r['n']:>8} {r['failures']:>4} {r['p50']:8.2f} {r['p99']:8.2f} {r['qps']:8.1f}")
    print(f"{'plain no-batch':15} {32:>4} {off['n']:>8} {off['failures']:>4} {off['p50']:8.2f} {off['p99']:8.2f} {off['qps']:8.1f}")

    get = {(lbl, c): r for lbl, c, r in rows}
    plain1, cons1, hit1 = get[("plain", 1)], get[("consistency-3", 1)], get[("cache-hit", 1)]
    checks = [
        ("plain search p50 <= 20 ms at concurrency 1", plain1["p50"], plain1["p50"] <= 20),
        ("consistency (3 paraphrases) p50 / plain p50 <= 2 at concurrency 1", cons1["p50"] / plain1["p50"],
         cons1["p50"] / plain1["p50"] <= 2),
        ("micro-batching on/off throughput >= 2 at concurrency 32", on["qps"] / off["qps"], on["qps"] / off["qps"] >= 2),
        ("cache hit p50 <= 3 ms at concurrency 1", hit1["p50"], hit1["p50"] <= 3),
    ]
    print()
    for text, value, ok in checks:
        print(f"{text}: {value:.2f} -> {'met' if ok else 'NOT met'}")
    failures = sum(r["failures"] for _, _, r in rows) + off["failures"]
    return 0 if all(ok for _, _, ok in checks) and failures == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
