"""`paraseek bench load` against a service on loopback, for a few seconds."""

import json

import pytest
from typer.testing import CliRunner

from paraseek.cli import app


def test_load_run_writes_reports_and_passes(uvicorn_server, demo_snapshot, tmp_path):
    url = uvicorn_server(demo_snapshot)
    out = tmp_path / "report"
    r = CliRunner().invoke(app, ["bench", "load", "--url", url, "--users", "4", "--spawn-rate", "4",
                                 "--duration", "4", "--out", str(out)])
    assert r.exit_code == 0, r.output
    summary = json.loads((out / "summary.json").read_text())
    assert summary["requests"] > 10 and summary["failures"] == 0 and summary["violations"] == []
    assert (out / "report.html").read_text().lower().startswith("<!doctype html")
    assert (out / "locust_stats.csv").is_file()


def test_missed_slo_exits_non_zero(uvicorn_server, demo_snapshot, tmp_path):
    url = uvicorn_server(demo_snapshot)
    r = CliRunner().invoke(app, ["bench", "load", "--url", url, "--users", "2", "--duration", "2",
                                 "--tag", "plain", "--slo-p50-ms", "0.001", "--out", str(tmp_path / "r")])
    assert r.exit_code == 1 and "p50" in r.output


def test_a_run_where_no_request_completes_fails_without_latencies(tmp_path):
    """A service that answers its health check and then never answers a query (overloaded, wedged): Locust
    has no percentile to write (N/A), and the run fails saying so instead of crashing on the number."""
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    release = threading.Event()

    class Wedged(BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def _answer(self):
            if self.path != "/healthz":
                release.wait(30)
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.end_headers()
            self.wfile.write(b"{}")

        do_GET = do_POST = _answer

    server = ThreadingHTTPServer(("127.0.0.1", 0), Wedged)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        out = tmp_path / "r"
        r = CliRunner().invoke(app, ["bench", "load", "--url", f"http://127.0.0.1:{server.server_port}", "--users", "2",
                                     "--duration", "2", "--slo-p50-ms", "100", "--out", str(out)])
    finally:
        release.set()
        server.shutdown()
    assert r.exit_code == 1, r.output
    assert "0 requests" in r.stdout and "p50 n/a, p95 n/a, p99 n/a" in r.stdout
    assert "no request completed (no latency to hold to the SLO)" in r.stderr
    summary = json.loads((out / "summary.json").read_text())
    assert summary["requests"] == 0 and summary["p50_ms"] is None


@pytest.mark.quick
def test_no_service_is_a_clear_error(tmp_path):
    r = CliRunner().invoke(app, ["bench", "load", "--url", "http://127.0.0.1:9", "--duration", "1", "--out", str(tmp_path)])
    assert r.exit_code == 2 and "no paraseek service" in r.output
