"""Soak and fault run, bounded and loopback only: a mixed load at a fixed rate against ``paraseek
serve`` (with its own redis-server) while Redis is killed and restarted, the bundle is reloaded and the
snapshot reindexed. Prints requests, failures, 5xx, p50/p99 and the server's RSS after warm-up and at
the end; exits non-zero on any 5xx, any failed query, or RSS growth over ``--max-rss-growth``.

    python -m paraseek.loadtests.soak [--seconds 120] [--rate 25]
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import signal
import statistics
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from paraseek.core.demo import CAPTIONS_FILE, GALLERY_DIR
from paraseek.core.memory import process_memory
from paraseek.core.settings import Settings
from paraseek.loadtests.net import free_port
from paraseek.loadtests.queries import caption_groups
from paraseek.loadtests.server import start_server
from paraseek.training.embedded import ensure_embedded_default

TOKEN = "soak-admin-token"
DEFAULT_NLTK = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "nltk_data"


def start_redis(port: int, folder: Path) -> subprocess.Popen:
    exe = shutil.which("redis-server")
    if exe is None:
        raise SystemExit("redis-server is not installed (bash install.sh)")
    proc = subprocess.Popen([exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                             "--dir", str(folder)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    time.sleep(0.3)
    return proc


def bodies(groups: list[list[str]]):
    """Plain, expansion, consistency and batch requests in a fixed rotation."""
    i = 0
    while True:
        g = groups[i % len(groups)]
        kind = i % 4
        if kind == 0:
            yield "/v1/search", {"query": g[0], "k": 10}
        elif kind == 1:
            yield "/v1/search", {"query": g[0], "expansion": {"method": "wordnet", "n": 2}}
        elif kind == 2:
            yield "/v1/search", {"query": g[0], "consistency": {"paraphrases": g[1:3], "k": 10}}
        else:
            yield "/v1/search/batch", {"requests": [{"query": c} for c in g[:3]]}
        i += 1


async def load(url: str, rate: float, seconds: float, groups, stats: dict) -> None:
    gen = bodies(groups)
    async with httpx.AsyncClient(base_url=url, timeout=30) as client:

        async def one(path, body):
            t0 = time.perf_counter()
            try:
                r = await client.post(path, json=body)
                status = r.status_code
            except httpx.HTTPError:
                status = 0
            stats["latencies"].append(time.perf_counter() - t0)
            stats["requests"] += 1
            stats["failures"] += status != 200
            if status != 200 and len(stats.setdefault("examples", [])) < 3:
                stats["examples"].append(f"{path} -> {status}")
            stats["5xx"] += status >= 500

        tasks, start = [], time.perf_counter()
        n = 0
        while (now := time.perf_counter() - start) < seconds:
            tasks.append(asyncio.create_task(one(*next(gen))))
            n += 1
            await asyncio.sleep(max(0.0, n / rate - now))
        await asyncio.gather(*tasks)


async def faults(url: str, seconds: float, redis_port: int, redis_dir: Path, state: dict, sources: Path, bundle: Path,
                 pid: int) -> None:
    headers = {"Authorization": f"Bearer {TOKEN}"}
    async with httpx.AsyncClient(base_url=url, timeout=60, headers=headers) as admin:
        for step in range(1, 1000):
            await asyncio.sleep(seconds / 8)
            if step * seconds / 8 >= seconds:
                return
            action = step % 4
            if action == 1:
                state["redis"].kill()
                state["redis"].wait()
                state["events"].append("redis killed")
            elif action == 2:
                state["redis"] = start_redis(redis_port, redis_dir)
                state["events"].append("redis restarted")
            elif action == 3:
                r = await admin.post("/v1/admin/reload", json={"bundle": str(bundle)})
                state["events"].append(f"reload -> {r.status_code}")
            else:
                r = await admin.post("/v1/admin/reindex", json={"source": str(sources / "captions.json"),
                                                                 "images": str(sources / "gallery")})
                state["events"].append(f"reindex -> {r.status_code}")
            state["events"][-1] += f" (RSS {process_memory(pid).rss_mb:.0f} MB)"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seconds", type=float, default=120.0, help="length of the measured run (bounded)")
    p.add_argument("--warmup", type=float, default=40.0, help="load and one cycle of faults before RSS is first read")
    p.add_argument("--rate", type=float, default=25.0, help="requests per second")
    p.add_argument("--max-rss-growth", type=float, default=0.10)
    p.add_argument("--home", type=Path, default=None)
    p.add_argument("--nltk-data", type=Path, default=DEFAULT_NLTK if DEFAULT_NLTK.is_dir() else None,
                   help="NLTK data folder with WordNet, for the expansion requests")
    args = p.parse_args(argv)
    if args.seconds > 1800:
        raise SystemExit("--seconds is capped at 1800")

    work = Path(tempfile.mkdtemp(prefix="paraseek-soak-"))
    home = args.home or work / "home"
    bundle, snapshot = ensure_embedded_default(Settings(home=home))
    sources = work / "sources"  # the reindex root: a copy of the demo gallery
    shutil.copytree(GALLERY_DIR, sources / "gallery")
    shutil.copy(CAPTIONS_FILE, sources / "captions.json")
    shutil.copytree(bundle, sources / "bundle")  # reloads read it from under the reindex root
    snap = work / "snapshot"
    shutil.copytree(snapshot, snap)
    redis_port = free_port()
    state: dict = {"redis": start_redis(redis_port, work), "events": []}
    env = {"PARASEEK_HOME": str(home), "PARASEEK_BUNDLE": str(bundle), "PARASEEK_SNAPSHOT": str(snap),
           "PARASEEK_REDIS_URL": f"redis://127.0.0.1:{redis_port}/0", "PARASEEK_ADMIN_TOKEN": TOKEN,
           "PARASEEK_REINDEX_ROOT": str(sources), "PARASEEK_LOG_JSON": "false", "PARASEEK_REDIS_RETRY_AFTER_S": "1"}
    if args.nltk_data:
        env["NLTK_DATA"] = str(args.nltk_data)
    server, url = start_server(env, log=work / "server.log")
    groups = caption_groups(None, min_size=3)
    try:
        # warm-up: the same load and one cycle of every fault, so first-time allocations (a second
        # set of encoder sessions, the first reindex) are in the baseline and growth means a leak
        warm: dict[str, Any] = {"latencies": [], "requests": 0, "failures": 0, "5xx": 0}

        async def warm_up():
            await asyncio.gather(load(url, args.rate, args.warmup, groups, warm),
                                 faults(url, args.warmup, redis_port, work, state, sources, sources / "bundle", server.pid))

        asyncio.run(warm_up())
        state["events"].append("| measured:")
        rss_start = process_memory(server.pid).rss_mb
        stats: dict[str, Any] = {"latencies": [], "requests": 0, "failures": 0, "5xx": 0}

        async def run():
            await asyncio.gather(load(url, args.rate, args.seconds, groups, stats),
                                 faults(url, args.seconds, redis_port, work, state, sources, sources / "bundle", server.pid))

        asyncio.run(run())
        rss_end = process_memory(server.pid).rss_mb
    finally:
        server.send_signal(signal.SIGTERM)
        server.wait(15)
        if state["redis"].poll() is None:
            state["redis"].kill()
    lat = sorted(stats["latencies"])
    p50 = statistics.median(lat) * 1000
    p99 = lat[min(len(lat) - 1, int(0.99 * len(lat)))] * 1000
    growth = rss_end / rss_start - 1
    print(f"soak: {args.seconds:.0f} s at {args.rate:.0f} req/s after {args.warmup:.0f} s warm-up (loopback)")
    print(f"faults: {', '.join(state['events'])}")
    print(f"warm-up: requests {warm['requests']}, failures {warm['failures']}, 5xx {warm['5xx']}")
    print(f"requests {stats['requests']}, failures {stats['failures']}, 5xx {stats['5xx']}, p50 {p50:.1f} ms, p99 {p99:.1f} ms")
    if stats.get("examples"):
        print(f"failed requests, e.g.: {', '.join(stats['examples'])}")
    print(f"server RSS after warm-up {rss_start:.0f} MB, at the end {rss_end:.0f} MB ({growth:+.1%})")
    ok = stats["5xx"] + warm["5xx"] == 0 and stats["failures"] + warm["failures"] == 0 and growth <= args.max_rss_growth
    print("targets (0 5xx, 0 failed queries, RSS growth <= {:.0%}): {}".format(args.max_rss_growth, "met" if ok else "NOT met"))
    shutil.rmtree(work, ignore_errors=True)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
