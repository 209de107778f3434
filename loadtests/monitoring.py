"""A real Prometheus beside a load run: started on loopback with a scrape config for the target
service, queried over its HTTP API, its data kept with the run's reports. And the Grafana dashboard
the product ships, read as data: its panels' PromQL is what the run's report plots and what the tests
evaluate against a live Prometheus, so the dashboard cannot drift from the metrics the code exports."""

from __future__ import annotations

import json
import shutil
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

import httpx

from paraseek.core.errors import UserError
from paraseek.loadtests.net import free_port

# the one dashboard file is deploy/k8s/base/grafana/paraseek-dashboard.json (kustomize reads files only
# below its base: the ConfigMap is made of it; deploy/docker-compose.yml provisions it); the package
# holds a link to it, which the wheel resolves into a copy
DASHBOARD = Path(__file__).parent / "grafana" / "paraseek-dashboard.json"
JOB = "paraseek"


@dataclass(frozen=True)
class PanelQuery:
    panel: str
    kind: str  # the panel type: timeseries, heatmap, stat, table, bargauge
    expr: str
    legend: str


# Grafana's built-in variables the panels use, and what they stand for outside Grafana
VARIABLES = ("$__rate_interval", "$__range")


def dashboard_queries(path: Path = DASHBOARD, rate_interval: str = "1m", time_range: str = "1h") -> list[PanelQuery]:
    """Every target of every panel, in the dashboard's order, with Grafana's ``$__rate_interval`` (the
    window of rate(): Grafana takes at least 4 scrape intervals) and ``$__range`` (the dashboard's time
    range) replaced, so that Prometheus itself can evaluate them."""
    dashboard = json.loads(path.read_text())
    return [PanelQuery(p["title"], p["type"],
                       t["expr"].replace("$__rate_interval", rate_interval).replace("$__range", time_range),
                       t.get("legendFormat", ""))
            for p in dashboard["panels"] for t in p.get("targets", [])]


def rate_window(scrape_interval_s: float) -> str:
    """A rate() window for a run scraped every ``scrape_interval_s``: 5 scrapes, at least 5 s."""
    return f"{max(5.0, 5 * scrape_interval_s):g}s"


def find_prometheus() -> str:
    binary = shutil.which("prometheus")
    if binary is None:
        raise UserError("prometheus is not installed: `bash install.sh` installs Debian's package "
                        "(apt-get install prometheus), or put a prometheus binary on PATH")
    return binary


class Prometheus:
    """``prometheus`` scraping ``target_url``'s /metrics every ``scrape_interval_s``, its TSDB in
    ``data_dir`` (kept after ``stop``: the run's raw series). Use as a context manager."""

    def __init__(self, target_url: str, data_dir: Path, scrape_interval_s: float = 1.0, port: int | None = None):
        target = urlsplit(target_url)
        if not target.hostname or not target.port:
            raise UserError(f"--url {target_url!r}: give scheme, host and port (http://127.0.0.1:8000)")
        self.target = f"{target.hostname}:{target.port}"
        self.scheme = target.scheme or "http"
        self.data_dir = Path(data_dir)
        self.scrape_interval_s = scrape_interval_s
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None

    def config(self) -> str:
        interval = f"{self.scrape_interval_s:g}s"
        return json.dumps({  # YAML is a superset of JSON
            "global": {"scrape_interval": interval, "evaluation_interval": interval},
            "scrape_configs": [{"job_name": JOB, "scheme": self.scheme, "metrics_path": "/metrics",
                                "static_configs": [{"targets": [self.target]}]}],
        }, indent=2)

    def start(self, timeout_s: float = 60) -> Prometheus:
        binary = find_prometheus()
        self.data_dir.mkdir(parents=True, exist_ok=True)
        config = self.data_dir / "prometheus.yml"
        config.write_text(self.config())
        log = open(self.data_dir / "prometheus.log", "w")
        self.proc = subprocess.Popen(
            [binary, f"--config.file={config}", f"--storage.tsdb.path={self.data_dir / 'tsdb'}",
             f"--web.listen-address=127.0.0.1:{self.port}", "--storage.tsdb.retention.time=30d"],
            stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"prometheus exited: {(self.data_dir / 'prometheus.log').read_text()[-2000:]}")
            try:
                if httpx.get(f"{self.url}/-/ready", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        else:
            self.stop()
            raise RuntimeError(f"prometheus did not become ready within {timeout_s:g} s")
        return self

    def wait_scraped(self, timeout_s: float = 30) -> None:
        """Until the target has been scraped successfully (``up == 1``)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            result = self.query(f'up{{job="{JOB}"}}')
            if result and float(result[0]["value"][1]) == 1.0:
                return
            time.sleep(self.scrape_interval_s / 2)
        raise RuntimeError(f"prometheus never scraped {self.target}/metrics (see {self.data_dir / 'prometheus.log'})")

    def _api(self, path: str, params: dict) -> list[dict]:
        r = httpx.get(f"{self.url}/api/v1/{path}", params=params, timeout=30)
        body = r.json()
        if r.status_code != 200 or body.get("status") != "success":
            raise PromQLError(params.get("query", ""), body.get("error") or r.text)
        return body["data"]["result"]

    def query(self, expr: str, at: float | None = None) -> list[dict]:
        """An instant query: [{"metric": {...}, "value": [t, "v"]}, ...]."""
        return self._api("query", {"query": expr, **({"time": at} if at is not None else {})})

    def query_range(self, expr: str, start: float, end: float, step_s: float) -> list[dict]:
        """[{"metric": {...}, "values": [[t, "v"], ...]}, ...]."""
        return self._api("query_range", {"query": expr, "start": start, "end": end, "step": step_s})

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()  # flushes the head block to disk
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self.proc = None

    def __enter__(self) -> Prometheus:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


class PromQLError(RuntimeError):
    def __init__(self, expr: str, error: str):
        super().__init__(f"{expr}: {error}")
        self.expr, self.error = expr, error
