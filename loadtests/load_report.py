"""The report of a load run with Prometheus: one self-contained HTML file. At the top the run's settings
and the verdict against the SLO; then Locust's client-side latency percentiles and throughput over
time, next to every time-series panel of the shipped Grafana dashboard evaluated on the run's
Prometheus data, on the same time axis (seconds since the load started). Also ``panels.json``: each
dashboard query evaluated at the end of the run (the series it returned, or its error)."""

from __future__ import annotations

import base64
import csv
import html
import io
import json
import math
from pathlib import Path
from typing import Any

from paraseek.loadtests.monitoring import PanelQuery, Prometheus, PromQLError, dashboard_queries, rate_window


def _number(row: dict, key: str) -> float:
    value = row.get(key, "")
    return float(value) if value not in ("", "N/A") else math.nan


def read_history(history_csv: Path) -> list[dict[str, float]]:
    """Locust's per-second aggregated rows (``--csv-full-history``): time, users, rps, failures/s, p50/p95/p99 ms."""
    columns = {"t": "Timestamp", "users": "User Count", "rps": "Requests/s", "failures": "Failures/s",
               "p50": "50%", "p95": "95%", "p99": "99%"}
    with open(history_csv) as f:
        return [{k: _number(row, c) for k, c in columns.items()} for row in csv.DictReader(f) if row.get("Name") == "Aggregated"]


def run_queries(prometheus: Prometheus, start: float, end: float) -> list[PanelQuery]:
    """The dashboard's queries as Grafana would run them over this run: rate() over a few scrapes, the
    time range from the load's start to its end."""
    return dashboard_queries(rate_interval=rate_window(prometheus.scrape_interval_s), time_range=f"{math.ceil(end - start)}s")


def evaluate_panels(prometheus: Prometheus, queries: list[PanelQuery], at: float) -> list[dict[str, Any]]:
    """Every query as an instant query at ``at``: its series count and values, or its error."""
    out = []
    for q in queries:
        entry: dict[str, Any] = {"panel": q.panel, "expr": q.expr}
        try:
            result = prometheus.query(q.expr, at)
            entry["series"] = len(result)
            entry["values"] = {json.dumps(r["metric"], sort_keys=True): float(r["value"][1]) for r in result}
        except PromQLError as exc:
            entry["error"] = exc.error
        out.append(entry)
    return out


def _figure_png(fig) -> str:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=90, bbox_inches="tight")
    return base64.b64encode(buf.getvalue()).decode("ascii")


def _series_label(metric: dict, legend: str) -> str:
    label = legend
    for key, value in metric.items():
        label = label.replace("{{" + key + "}}", value)
    return label if "{{" not in label else ", ".join(f"{k}={v}" for k, v in metric.items() if k != "__name__") or "value"


def results_line(summary: dict) -> str:
    """A run's numbers in one line (the CLI's output and the load report's)."""
    def ms(value: float | None) -> str:
        return "n/a" if value is None else f"{value:.0f} ms"

    return (f"{summary['requests']} requests, {summary['failures']} failures ({summary['failure_ratio']:.2%}), "
            f"{summary['rps']:.1f} req/s; p50 {ms(summary['p50_ms'])}, p95 {ms(summary['p95_ms'])}, p99 {ms(summary['p99_ms'])}")


def write_report(out: Path, *, summary: dict, settings: dict, prometheus: Prometheus, start: float, end: float,
                 history_csv: Path, step_s: float = 1.0) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figures: list[tuple[str, str]] = []
    history = read_history(history_csv) if history_csv.is_file() else []
    if history:
        t = [r["t"] - start for r in history]
        fig, ax = plt.subplots(figsize=(6, 3))
        for key in ("p50", "p95", "p99"):
            ax.plot(t, [r[key] for r in history], label=key)
        ax.set(xlabel="s since start", ylabel="ms", title="Client latency (Locust)")
        ax.legend(fontsize=7)
        figures.append(("Client latency percentiles (Locust)", _figure_png(fig)))
        plt.close(fig)
        fig, ax = plt.subplots(figsize=(6, 3))
        ax.plot(t, [r["rps"] for r in history], label="requests/s")
        ax.plot(t, [r["failures"] for r in history], label="failures/s")
        ax2 = ax.twinx()
        ax2.plot(t, [r["users"] for r in history], color="grey", linestyle=":", label="users")
        ax2.set_ylabel("users")
        ax.set(xlabel="s since start", ylabel="per second", title="Client throughput (Locust)")
        ax.legend(fontsize=7, loc="upper left")
        figures.append(("Client throughput (Locust)", _figure_png(fig)))
        plt.close(fig)

    panels: dict[str, list[PanelQuery]] = {}
    for q in run_queries(prometheus, start, end):
        if q.kind == "timeseries":
            panels.setdefault(q.panel, []).append(q)
    for title, queries in panels.items():
        fig, ax = plt.subplots(figsize=(6, 3))
        drawn = 0
        for q in queries:
            try:
                result = prometheus.query_range(q.expr, start, end, step_s)
            except PromQLError:
                continue
            for series in result:
                points = [(float(ts) - start, float(v)) for ts, v in series["values"]]
                ax.plot([p[0] for p in points], [p[1] for p in points], label=_series_label(series["metric"], q.legend))
                drawn += 1
        ax.set(xlabel="s since start", title=f"{title} (Prometheus)")
        if 0 < drawn <= 12:
            ax.legend(fontsize=6)
        figures.append((title, _figure_png(fig)))
        plt.close(fig)

    verdict = "PASS" if not summary["violations"] else "FAIL"
    rows = "".join(f"<tr><th>{html.escape(str(k))}</th><td>{html.escape(str(v))}</td></tr>" for k, v in settings.items())
    results = results_line(summary)
    violations = "".join(f"<li>{html.escape(v)}</li>" for v in summary["violations"])
    images = "".join(f'<figure><img alt="{html.escape(title)}" src="data:image/png;base64,{png}">'
                     f"<figcaption>{html.escape(title)}</figcaption></figure>" for title, png in figures)
    page = f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>paraseek load run: {verdict}</title>
<style>
body {{ font-family: system-ui, sans-serif; margin: 1.5rem; color: #222; }}
.verdict {{ font-size: 1.4rem; font-weight: bold; padding: .4rem .8rem; display: inline-block; border-radius: .3rem; }}
.PASS {{ background: #d7f5dd; color: #135c24; }} .FAIL {{ background: #fbdada; color: #8a1111; }}
table {{ border-collapse: collapse; margin: .8rem 0; }} th, td {{ text-align: left; padding: .15rem .8rem .15rem 0; }}
th {{ font-weight: 600; }}
.grid {{ display: grid; grid-template-columns: repeat(auto-fill, minmax(520px, 1fr)); gap: 1rem; }}
figure {{ margin: 0; }} img {{ max-width: 100%; }} figcaption {{ font-size: .8rem; color: #555; }}
</style></head><body>
<h1>paraseek load run</h1>
<p><span class="verdict {verdict}">{verdict}</span> &nbsp; {html.escape(results)}</p>
{f"<ul>{violations}</ul>" if violations else ""}
<table>{rows}</table>
<p>First what the load generator saw, then the service's own series, scraped by Prometheus every
{settings.get("scrape interval", "?")} during the run: the time-series panels of the shipped Grafana
dashboard (<code>deploy/k8s/base/grafana/paraseek-dashboard.json</code>), rate() over
{rate_window(prometheus.scrape_interval_s)}, on the same time axis.</p>
<div class="grid">{images}</div>
</body></html>
"""
    path = out / "load-report.html"
    path.write_text(page)
    return path
