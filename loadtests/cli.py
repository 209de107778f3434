"""``paraseek bench ...``: benchmarks that print side-by-side ratios measured in one run, and the
Locust load runner."""

from __future__ import annotations

import sys
from dataclasses import asdict
from pathlib import Path
from typing import Callable, List, Optional

import httpx
import typer

from paraseek.core.cli_support import console, err, user_errors
from paraseek.core.errors import UserError
from paraseek.loadtests import (  # bench_encoder imports torch only when run
    bench_encoder,
    bench_expansion,
    bench_filters,
    bench_gpu,
    bench_index,
    bench_large,
    bench_service,
    bench_training,
    bench_vectors,
)
from paraseek.loadtests.load import run_load
from paraseek.loadtests.load_report import results_line

app = typer.Typer(help="Benchmarks (print side-by-side ratios measured in one run).", no_args_is_help=True)


@app.command("encoder")
def encoder_cmd(
    repeats: int = typer.Option(30, min=3, help="Timed runs per configuration (median reported)."),
    workdir: Optional[Path] = typer.Option(None, help="Where to export the benchmark bundles."),
    threads: int = typer.Option(0, help="onnxruntime/torch threads (0: all cores)."),
):
    """torch eager (77 tokens) vs bundle runtime (fp32/int8, truncated), batch 1 and 32."""
    sys.exit(bench_encoder.run(repeats=repeats, workdir=workdir, threads=threads or None))


# name -> the benchmark module's main: its options are its argparse parser's (the CLI reference reads
# them from there)
PASS_THROUGH: dict[str, Callable[[list[str]], int]] = {}


def _pass_through(name: str, main: Callable[[list[str]], int], help: str) -> None:
    """``paraseek bench NAME ...``: the benchmark module's own argparse options, passed on as given."""
    PASS_THROUGH[name] = main
    def command(ctx: typer.Context) -> None:
        sys.exit(main(ctx.args))

    app.command(name, help=help, context_settings={"allow_extra_args": True, "ignore_unknown_options": True})(command)


for _name, _main, _help in (
    ("index", bench_index.main, "Build throughput; flat/HNSW/IVF latency, QPS and recall at 10K-1M (options: --sizes, --kinds, --data)."),
    ("vectors", bench_vectors.main, "Snapshots from precomputed vectors in shards: vectors/s, peak RSS, x the time to read the "
     "shards (--count, --shards)."),
    ("large", bench_large.main, "10M vectors built with the defaults and served memory-mapped: build time, disk, peak memory; "
     "the server's private and file-backed memory, cold first query, recall, p50/p99 at concurrency 1 and 32 (--count, --work)."),
    ("expansion", bench_expansion.main, "What bank expansion, keep_first, the query head and the first-answer lead cost per "
     "request on the embedded default (--seconds, --rounds, --starter plain)."),
    ("filters", bench_filters.main, "Filtered ANN search: first-search cost of a new filter, then p50 with a bitmap vs a "
     "hash-set id selector (--size, --snapshot)."),
    ("service", bench_service.main, "End-to-end latency/throughput at concurrency 1 and 32, micro-batching on vs off "
     "(options: --seconds; --bundle B --skip-demo serves a bundle of yours, on a GPU where onnxruntime has one)."),
    ("training", bench_training.main, "A training recipe's step on this machine's GPU (or CPU): seconds a step, texts/s, "
     "peak memory and the projected run at each batch size, and the run's one-off costs (--model, --batch-sizes)."),
    ("gpu", bench_gpu.main, "The text tower on each execution provider (CUDA, TensorRT, CPU) at each precision the "
     "bundle holds, and flat/IVF search on CPU and faiss' GPUs, side by side (--bundle, --sizes)."),
):
    _pass_through(_name, _main, _help)


@app.command("load")
@user_errors
def load_cmd(
    url: str = typer.Option("http://127.0.0.1:8000", envvar="PARASEEK_URL", help="A running paraseek service (nothing is started)."),
    users: int = typer.Option(20, min=1),
    spawn_rate: float = typer.Option(5.0, min=0.1),
    duration: int = typer.Option(30, min=1, help="Seconds."),
    tags: List[str] = typer.Option([], "--tag", help="Only these scenarios (plain, cache, consistency, expansion, batch, info)."),
    out: Path = typer.Option(Path("loadtest-report"), help="Folder for the CSV/HTML reports and summary.json."),
    max_failure_ratio: float = typer.Option(0.0, min=0.0, max=1.0),
    slo_p99_ms: Optional[float] = typer.Option(None, help="Fail if the aggregated p99 is above this."),
    slo_p50_ms: Optional[float] = typer.Option(None, help="Fail if the aggregated p50 is above this."),
    queries: Optional[Path] = typer.Option(None, help="TSV of image_id/caption to draw queries from."),
    with_prometheus: bool = typer.Option(False, "--with-prometheus", help="Also run Prometheus (Debian's package) "
                                         "scraping the service during the load; keep its data in OUT/prometheus and "
                                         "write OUT/load-report.html: client and server series on one time axis."),
    scrape_interval: float = typer.Option(1.0, min=0.1, help="Prometheus scrape interval, seconds (--with-prometheus)."),
):
    """Run Locust headless against a running service; non-zero exit on failures or a missed SLO."""
    try:
        httpx.get(url.rstrip("/") + "/healthz", timeout=5).raise_for_status()
    except httpx.HTTPError as exc:
        raise UserError(f"no paraseek service answers at {url}: {exc}") from exc
    s = run_load(url, users=users, spawn_rate=spawn_rate, duration_s=duration, out=out, tags=tags or None,
                 max_failure_ratio=max_failure_ratio, slo_p99_ms=slo_p99_ms, slo_p50_ms=slo_p50_ms, queries=queries,
                 with_prometheus=with_prometheus, scrape_interval_s=scrape_interval)
    console.print(results_line(asdict(s)))
    console.print(f"HTML report: {s.html_report}")
    if s.load_report:
        console.print(f"client and server series: {s.load_report}; Prometheus data: {s.prometheus_data}")
        for panel in s.panels_without_data:
            err.print(f"[yellow]no data:[/yellow] {panel}")
    for v in s.violations:
        err.print(f"[red]violation:[/red] {v}")
    raise typer.Exit(1 if s.violations else 0)
