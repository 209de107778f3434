"""`paraseek bench load`: run Locust headless against a running paraseek, save CSV and HTML reports
and a summary, and fail on too many failures or a missed SLO. Starts no server: only Locust."""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
from dataclasses import asdict, dataclass
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
    p50_ms: float
    p95_ms: float
    p99_ms: float
    html_report: str
    csv_prefix: str
    violations: list[str]


def _aggregated(stats_csv: Path) -> dict:
    with open(stats_csv) as f:
        for row in csv.DictReader(f):
            if row["Name"] == "Aggregated":
                return row
    raise RuntimeError(f"no aggregated row in {stats_csv}")


def run_load(url: str, *, users: int = 20, spawn_rate: float = 5, duration_s: int = 30, out: Path,
             tags: list[str] | None = None, max_failure_ratio: float = 0.0, slo_p99_ms: float | None = None,
             slo_p50_ms: float | None = None, queries: Path | None = None) -> LoadSummary:
    out.mkdir(parents=True, exist_ok=True)
    prefix = out / "locust"
    html = out / "report.html"
    cmd = [sys.executable, "-m", "locust", "-f", str(LOCUSTFILE), "--headless", "--host", url,
           "-u", str(users), "-r", str(spawn_rate), "-t", f"{duration_s}s", "--csv", str(prefix),
           "--html", str(html), "--only-summary", "--exit-code-on-error", "0", "--stop-timeout", "5"]
    if tags:
        cmd += ["--tags", *tags]
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
    p50, p95, p99 = float(agg["50%"]), float(agg["95%"]), float(agg["99%"])
    violations = []
    if requests == 0:
        violations.append("no request completed")
    if ratio > max_failure_ratio:
        violations.append(f"failure ratio {ratio:.4f} > {max_failure_ratio}")
    if slo_p99_ms is not None and p99 > slo_p99_ms:
        violations.append(f"p99 {p99:.0f} ms > SLO {slo_p99_ms:.0f} ms")
    if slo_p50_ms is not None and p50 > slo_p50_ms:
        violations.append(f"p50 {p50:.0f} ms > SLO {slo_p50_ms:.0f} ms")
    summary = LoadSummary(url=url, users=users, duration_s=duration_s, requests=requests, failures=failures,
                          failure_ratio=ratio, rps=float(agg["Requests/s"]), p50_ms=p50, p95_ms=p95, p99_ms=p99,
                          html_report=str(html), csv_prefix=str(prefix), violations=violations)
    (out / "summary.json").write_text(json.dumps(asdict(summary), indent=2))
    return summary
