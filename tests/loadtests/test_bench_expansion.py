"""loadtests/bench_expansion.py against a real server on the embedded default (plain starter, a small
bank with a random query head put where the embedded default looks for it)."""

import shutil

import pytest

from paraseek.core.bundle import read_manifest
from paraseek.loadtests import bench_expansion
from paraseek.paraphrase.caption_bank import CaptionBank, bank_dir
from tests.paraphrase.test_query_head import random_head


def test_bench_expansion_serves_every_configuration_and_prints_the_ratios(starter_bundle, starter_bank, shared_data,
                                                                         tmp_path, monkeypatch, capsys):
    home = tmp_path / "home"
    monkeypatch.setenv("PARASEEK_STARTER", "robust")  # --starter wins over the environment
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    shutil.copytree(starter_bundle, home / "bundles" / "starter")
    bank = bank_dir(home, read_manifest(starter_bundle, verify=False))
    shutil.copytree(starter_bank.path, bank)
    CaptionBank.read(bank).with_head(random_head(dim=starter_bank.manifest.dim, hidden=16, scale=0.1))
    monkeypatch.setenv("PARASEEK_FIRST_ANSWER_BUNDLE", str(home / "bundles" / "starter"))  # the lead row runs too
    code = bench_expansion.main(["--data", str(shared_data), "--home", str(home), "--seconds", "0.5", "--rounds", "1",
                                 "--concurrency", "1", "2", "--starter", "plain"])
    out = capsys.readouterr().out
    assert code == 0, out  # no request failed
    assert "the embedded default (paraseek-starter v" in out  # the plain starter served, as asked
    assert "first-answer bundle paraseek-starter v" in out
    rows = [line.split() for line in out.splitlines() if line.startswith(("none", "bank30", "bank64", "bank72", "bank96", "head"))]
    assert len(rows) == 32  # sixteen configurations at two concurrencies
    # each row's last-but-one column is its p50 over the bank30 row's p50 at the same concurrency
    for conc in ("1", "2"):
        same = [r for r in rows if r[-6] == conc]
        assert len(same) == 16
        base = float(next(r for r in same if r[0] == "bank30")[-5])
        for r in same:
            assert float(r[-2]) == pytest.approx(float(r[-5]) / base, abs=0.01), r
