"""Overload benchmark: what the service does at four times the load it can serve.

One run, on the embedded default (the demo gallery, plain searches of captions never sent before):

1. capacity: a closed loop at ``--concurrency`` (default 8) for ``--seconds``: X requests/s, p50, p99;
2. overload with load shedding: an open loop sending 4X requests/s (each on schedule, whatever the
   answers) to a server with ``PARASEEK_MAX_IN_FLIGHT`` = the concurrency: the accepted requests'
   p50/p99 and rate, how fast the refused ones get their 503, any other status, and the server's RSS
   (before, peak, after);
3. the same overload against a server without the in-flight limit (``PARASEEK_MAX_IN_FLIGHT`` 100000;
   only its batchers' queue bound refuses anything), as a side-by-side reference.

Targets (exit 1 when missed): with shedding, accepted p99 <= 1.5 x the capacity p99, 503s answered
with p99 <= 50 ms, no status but 200 and 503, and peak RSS <= 1.1 x RSS before the overload.

    python -m paraseek.loadtests.bench_overload [--seconds 10] [--concurrency 8] [--factor 4] [--home DIR]
"""

from __future__ import annotations

import argparse
import asyncio
import time
from pathlib import Path

import aiohttp
import orjson

from paraseek.core.memory import MemorySampler, process_memory
from paraseek.core.settings import Settings
from paraseek.loadtests import temporary_folder
from paraseek.loadtests.bench_service import drive, start_paraseek
from paraseek.loadtests.queries import caption_groups
from paraseek.loadtests.server import stop_server
from paraseek.training.embedded import ensure_embedded_default


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1000


async def open_loop(url: str, make_body, rate: float, seconds: float) -> dict:
    """Send ``rate`` requests/s for ``seconds`` on schedule, whatever the answers (bounded: rate x
    seconds requests, each with a 30 s timeout)."""
    by_status: dict[int, list[float]] = {}
    headers = {"content-type": "application/json"}
    timeout = aiohttp.ClientTimeout(total=30)
    async with aiohttp.ClientSession(base_url=url, connector=aiohttp.TCPConnector(limit=0), timeout=timeout) as client:

        async def one(i: int) -> None:
            t0 = time.perf_counter()
            try:
                async with client.post("/v1/search", data=orjson.dumps(make_body(i)), headers=headers) as r:
                    await r.read()
                    status = r.status
            except (TimeoutError, aiohttp.ClientError):
                status = 0  # no answer at all
            by_status.setdefault(status, []).append(time.perf_counter() - t0)

        total = int(rate * seconds)
        start = time.perf_counter()
        tasks = []
        for i in range(total):
            delay = start + i / rate - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(i)))
        await asyncio.gather(*tasks)
        elapsed = time.perf_counter() - start
    ok, shed = by_status.get(200, []), by_status.get(503, [])
    return {"sent": total, "ok": len(ok), "ok_rate": len(ok) / seconds, "p50": percentile(ok, 0.5), "p99": percentile(ok, 0.99),
            "shed": len(shed), "shed_p99": percentile(shed, 0.99), "elapsed": elapsed,
            "other": {s: len(v) for s, v in by_status.items() if s not in (200, 503)}}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--factor", type=float, default=4.0)
    parser.add_argument("--home", type=Path, default=None, help="PARASEEK_HOME (default: a temporary folder)")
    args = parser.parse_args(argv)
    home = args.home or temporary_folder("paraseek-overload-")
    ensure_embedded_default(Settings(home=home))  # built here, so that both servers start as a warm install does
    captions = [c for group in caption_groups() for c in group]  # the demo gallery's captions

    def body(i: int) -> dict:  # a caption and a number: never sent before, so never a cache hit
        return {"query": f"{captions[i % len(captions)]} {i:08d}", "k": 10, "expansion": {"method": "none"}}

    rows = {}
    for name, limit in (("shedding", args.concurrency), ("no limit", 100_000)):
        proc, url = start_paraseek(home, PARASEEK_MAX_IN_FLIGHT=limit)
        try:
            if name == "shedding":
                capacity = asyncio.run(drive(url, lambda i: body(10**6 + i), args.concurrency, args.seconds))
                rate = args.factor * capacity["qps"]
                print(f"capacity at concurrency {args.concurrency}: {capacity['qps']:.1f} req/s, "
                      f"p50 {capacity['p50']:.1f} ms, p99 {capacity['p99']:.1f} ms; overload: {rate:.0f} req/s "
                      f"({args.factor:g}x) for {args.seconds:g} s")
            before = process_memory(proc.pid).rss_mb
            with MemorySampler(proc.pid) as rss:
                row = asyncio.run(open_loop(url, lambda i: body(2 * 10**6 + i), rate, args.seconds))
            row.update(rss_before=before, rss_peak=rss.peak_rss, rss_after=process_memory(proc.pid).rss_mb)
            rows[name] = row
        finally:
            stop_server(proc, 30)
    print(f"{'server':<12} {'sent':>6} {'200':>6} {'200/s':>7} {'p50 ms':>8} {'p99 ms':>8} {'503':>6} {'503 p99':>8} "
          f"{'other':>6} {'RSS MB before/peak/after':>26}")
    for name, r in rows.items():
        print(f"{name:<12} {r['sent']:>6} {r['ok']:>6} {r['ok_rate']:>7.1f} {r['p50']:>8.1f} {r['p99']:>8.1f} {r['shed']:>6} "
              f"{r['shed_p99']:>8.1f} {sum(r['other'].values()):>6} "
              f"{r['rss_before']:>8.0f}/{r['rss_peak']:.0f}/{r['rss_after']:.0f}")
    s = rows["shedding"]
    checks = {
        f"accepted p99 / capacity p99 = {s['p99'] / capacity['p99']:.2f} (<= 1.5)": s["p99"] <= 1.5 * capacity["p99"],
        f"503 p99 = {s['shed_p99']:.1f} ms (<= 50)": not s["shed"] or s["shed_p99"] <= 50,
        f"statuses other than 200/503: {s['other'] or 'none'}": not s["other"],
        f"peak RSS / RSS before = {s['rss_peak'] / s['rss_before']:.3f} (<= 1.10)": s["rss_peak"] <= 1.10 * s["rss_before"],
        f"accepted rate / capacity = {s['ok_rate'] / capacity['qps']:.2f}": True,
        f"without the in-flight limit: accepted p99 {rows['no limit']['p99'] / capacity['p99']:.1f}x the capacity p99": True,
    }
    for text, ok in checks.items():
        print(("met     " if ok else "MISSED  ") + text)
    return 0 if all(checks.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
