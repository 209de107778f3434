"""`paraseek bench load` against a service on loopback, for a few seconds."""

import json

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


def test_no_service_is_a_clear_error(tmp_path):
    r = CliRunner().invoke(app, ["bench", "load", "--url", "http://127.0.0.1:9", "--duration", "1", "--out", str(tmp_path)])
    assert r.exit_code == 2 and "no paraseek service" in r.output
