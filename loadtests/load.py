"""`paraseek bench load`: run Locust headless against a running paraseek, save CSV and HTML reports
and a summary, and fail on too many failures or a missed SLO. Starts no service: Locust, and with
``with_prometheus`` a Prometheus scraping the service, whose data stays with the reports and feeds
``load-report.html`` (client and server series on one time axis) and ``panels.json``."""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

LOCUSTFILE = Path(__file__).resolve().parent / "locustfile.py"


@dataclass
class LoadSummary:
    url: str
    users: int
    duration_s: float
    requests: int
    failures: int
    failure_ratio: float
    rps: float
    p50_ms: float | None  # None when no request completed (Locust writes N/A)
    p95_ms: float | None
    p99_ms: float | None
    html_report: str
    csv_prefix: str
    violations: list[str]
    prometheus_data: str | None = None  # the run's Prometheus TSDB (with_prometheus)
    load_report: str | None = None  # load-report.html (with_prometheus)
    panels_without_data: list[str] = field(default_factory=list)  # dashboard queries that returned no series


def _latency_ms(value: str) -> float | None:
    """A percentile column of Locust's statistics: N/A when no request completed."""
    try:
        return float(value)
    except ValueError:
        return None


def _aggregated(stats_csv: Path) -> dict:
    with open(stats_csv) as f:
        for row in csv.DictReader(f):
            if row["Name"] == "Aggregated":
                return row
    raise RuntimeError(f"no aggregated row in {stats_csv}")


def run_load(url: str, *, users: int = 20, spawn_rate: float = 5, duration_s: int = 30, out: Path,
             tags: list[str] | None = None, max_failure_ratio: float = 0.0, slo_p99_ms: float | None = None,
             slo_p50_ms: float | None = None, queries: Path | None = None, with_prometheus: bool = False,
             scrape_interval_s: float = 1.0) -> LoadSummary:
    if not with_prometheus:
        return _run_locust(url, users=users, spawn_rate=spawn_rate, duration_s=duration_s, out=out, tags=tags,
                           max_failure_ratio=max_failure_ratio, slo_p99_ms=slo_p99_ms, slo_p50_ms=slo_p50_ms, queries=queries)
    from paraseek.loadtests.load_report import evaluate_panels, run_queries, write_report
    from paraseek.loadtests.monitoring import Prometheus

    out.mkdir(parents=True, exist_ok=True)
    with Prometheus(url, out / "prometheus", scrape_interval_s) as prometheus:
        prometheus.wait_scraped()
        start = time.time()
        summary = _run_locust(url, users=users, spawn_rate=spawn_rate, duration_s=duration_s, out=out, tags=tags,
                              max_failure_ratio=max_failure_ratio, slo_p99_ms=slo_p99_ms, slo_p50_ms=slo_p50_ms,
                              queries=queries, full_history=True)
        time.sleep(2 * scrape_interval_s)  # the last requests' effect scraped
        end = time.time()
        panels = evaluate_panels(prometheus, run_queries(prometheus, start, end), end)
        (out / "panels.json").write_text(json.dumps(panels, indent=2))
        settings = {"service": url, "users": users, "spawn rate": f"{spawn_rate:g}/s", "duration": f"{duration_s} s",
                    "scenarios": ", ".join(tags) if tags else "all", "scrape interval": f"{scrape_interval_s:g} s",
                    "SLO p50": f"{slo_p50_ms:g} ms" if slo_p50_ms is not None else "none",
                    "SLO p99": f"{slo_p99_ms:g} ms" if slo_p99_ms is not None else "none",
                    "max failure ratio": f"{max_failure_ratio:g}", "started": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(start))}
        report = write_report(out, summary=asdict(summary), settings=settings, prometheus=prometheus, start=start, end=end,
                              history_csv=out / "locust_stats_history.csv", step_s=scrape_interval_s)
    summary.prometheus_data = str(out / "prometheus")
    summary.load_report = str(report)
    summary.panels_without_data = [f"{p['panel']}: {p['expr']}" for p in panels if not p.get("series")]
    (out / "summary.json").write_text(json.dumps(asdict(summary), indent=2))
    return summary


def _run_locust(url: str, *, users: int, spawn_rate: float, duration_s: int, out: Path, tags: list[str] | None,
                max_failure_ratio: float, slo_p99_ms: float | None, slo_p50_ms: float | None, queries: Path | None,
                full_history: bool = False) -> LoadSummary:
    out.mkdir(parents=True, exist_ok=True)
    prefix = out / "locust"
    html = out / "report.html"
    cmd = [sys.executable, "-m", "locust", "-f", str(LOCUSTFILE), "--headless", "--host", url,
           "-u", str(users), "-r", str(spawn_rate), "-t", f"{duration_s}s", "--csv", str(prefix),
           "--html", str(html), "--only-summary", "--exit-code-on-error", "0", "--stop-timeout", "5"]
    if tags:
        cmd += ["--tags", *tags]
    if full_history:  # one aggregated row per second: the report's client-side time series
        cmd += ["--csv-full-history"]
    env = None
    if queries:  # the Locust process reads it through Settings().load_queries
        env = {**os.environ, "PARASEEK_LOAD_QUERIES": str(queries)}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=duration_s + 120)
    (out / "locust.log").write_text(proc.stdout + proc.stderr)
    stats = prefix.with_name(prefix.name + "_stats.csv")
    if proc.returncode != 0 or not stats.is_file():
        raise RuntimeError(f"locust failed (exit {proc.returncode}): {(proc.stdout + proc.stderr)[-2000:]}")
    agg = _aggregated(stats)
    requests, failures = int(agg["Request Count"]), int(agg["Failure Count"])
    ratio = failures / requests if requests else 1.0
    p50, p95, p99 = (_latency_ms(agg[column]) for column in ("50%", "95%", "99%"))
    violations = []
    if requests == 0:  # and no latency to hold against an SLO
        violations.append("no request completed" + (" (no latency to hold to the SLO)" if slo_p50_ms or slo_p99_ms else ""))
    if ratio > max_failure_ratio:
        violations.append(f"failure ratio {ratio:.4f} > {max_failure_ratio}")
    if slo_p99_ms is not None and p99 is not None and p99 > slo_p99_ms:
        violations.append(f"p99 {p99:.0f} ms > SLO {slo_p99_ms:.0f} ms")
    if slo_p50_ms is not None and p50 is not None and p50 > slo_p50_ms:
        violations.append(f"p50 {p50:.0f} ms > SLO {slo_p50_ms:.0f} ms")
    summary = LoadSummary(url=url, users=users, duration_s=duration_s, requests=requests, failures=failures,
                          failure_ratio=ratio, rps=float(agg["Requests/s"]), p50_ms=p50, p95_ms=p95, p99_ms=p99,
                          html_report=str(html), csv_prefix=str(prefix), violations=violations)
    (out / "summary.json").write_text(json.dumps(asdict(summary), indent=2))
    return summary
