"""loadtests/research/bench_hubness.py against a real server: a small synthetic collection, the starter and its bank."""

import pytest

from paraseek.loadtests.research import bench_hubness


def test_bench_hubness_waits_for_the_table_and_prints_both_rows(starter_bundle, starter_bank, shared_data, tmp_path,
                                                               monkeypatch, capsys):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    code = bench_hubness.main(["--data", str(shared_data), "--work", str(tmp_path), "--size", "3000",
                               "--bundle", str(starter_bundle), "--bank", str(starter_bank.path),
                               "--seconds", "0.5", "--rounds", "1", "--concurrency", "1", "--table-timeout", "120"])
    out = capsys.readouterr().out
    assert code == 0, out  # the table was written and no request failed
    assert "hub correction on 3,000 images" in out and "this checkout's hub table: written" in out
    rows = [line.split() for line in out.splitlines() if line.startswith("this checkout:")]
    assert len(rows) == 2
    base = float(rows[1][-5])  # the hub-0 row's p50 is the ratios' base: each row's p50 over it
    assert [float(r[-2]) for r in rows] == [pytest.approx(float(r[-5]) / base, abs=0.01) for r in rows]
    assert len(list((tmp_path / "home" / "hub-tables").glob("*.npz"))) == 1  # the one `index hub-table` wrote
    assert "written beforehand by `paraseek index hub-table`" in out and "never (failed)" not in out
