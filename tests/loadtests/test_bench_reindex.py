"""The reindex benchmark builds both ways side by side and prints the ratio."""

from paraseek.loadtests.bench_reindex import main


def test_bench_reindex_encodes_only_the_rewritten_photos_and_agrees(starter_bundle, shared_data, capsys):
    result = main(["--data", str(shared_data), "--bundle", str(starter_bundle), "--photos", "8", "--changed", "0.25",
                   "--moved", "0.25", "--rounds", "2", "--files", "300"])
    assert result["photos"] == 8 and result["changed"] == 2
    assert result["encoded"] == {"encode all": 8, "reuse unchanged": 2}  # the edited photos only
    assert 1 <= result["moved"] <= 2  # moved photos keep their vectors (one also edited is encoded)
    assert result["max_abs_difference"] < 1e-5  # the reused vectors are the ones encoding gives
    assert all(s > 0 for s in result["seconds"].values()) and result["speedup"] > 0
    assert result["lookup"]["files"] == 300 and result["lookup"]["open_s"] > 0 and result["lookup"]["find_s"] > 0
    assert result["lookup"]["digest_s"] > 0 and result["lookup"]["unchanged_build_s"] > 0 and result["unchanged_s"] > 0
    assert result["lookup"]["unchanged_checksum_build_s"] > 0 and result["unchanged_checksum_s"] > 0
    out = capsys.readouterr().out
    assert "reuse unchanged / encode all:" in out and "x faster" in out and "a rebuild of 300 unchanged files" in out
    assert "nothing changed" in out and "(no version written)" in out and "by checksum" in out and "with --checksum" in out
