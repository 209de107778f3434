"""The reindex benchmark builds both ways side by side and prints the ratio."""

import pytest

from paraseek.loadtests.bench_reindex import main


def test_bench_reindex_encodes_only_the_rewritten_photos_and_agrees(starter_bundle, shared_data, capsys):
    result = main(["--data", str(shared_data), "--bundle", str(starter_bundle), "--photos", "8", "--changed", "0.25",
                   "--moved", "0.25", "--rounds", "2", "--files", "300"])
    assert result["photos"] == 8 and result["changed"] == 2
    assert result["encoded"] == {"encode all": 8, "reuse unchanged": 2}  # the edited photos only
    assert 1 <= result["moved"] <= 2  # moved photos keep their vectors (one also edited is encoded)
    assert result["max_abs_difference"] < 1e-5  # the reused vectors are the ones encoding gives
    out = capsys.readouterr().out
    # what it prints is what it measured: each build's median, their ratio, the lookups
    seconds, lookup = result["seconds"], result["lookup"]
    assert set(seconds) == {"encode all", "reuse unchanged"} and lookup["files"] == 300
    for name, s in seconds.items():
        assert f"{name:16} {s:8.2f}" in out
    assert result["speedup"] == pytest.approx(seconds["encode all"] / seconds["reuse unchanged"])
    assert f"reuse unchanged / encode all: {result['speedup']:.1f}x faster" in out
    assert f"{'nothing changed':16} {result['unchanged_s']:8.2f}" in out and f"{'  by checksum':16} {result['unchanged_checksum_s']:8.2f}" in out
    assert (f"{lookup['open_s']:.2f} s listing and confining the folder, {lookup['find_s']:.2f} s finding their vectors" in out
            and f"{lookup['digest_s']:.2f} s digesting its inputs" in out
            and f"{lookup['unchanged_build_s']:.2f} s (the version kept), {lookup['unchanged_checksum_build_s']:.2f} s" in out)
    assert "reuse unchanged / encode all:" in out and "x faster" in out and "a rebuild of 300 unchanged files" in out
    assert "nothing changed" in out and "(no version written)" in out and "by checksum" in out and "with --checksum" in out
