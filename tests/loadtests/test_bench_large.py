"""The bigger-than-memory benchmark, small: 210K vectors whose index may take 50 MB of memory (so
``auto`` builds ivf_pq with refine), served memory-mapped by a real ``paraseek serve``."""

import json

from paraseek.loadtests.bench_large import main


def test_bench_large_builds_serves_and_measures(tmp_path, shared_data, starter_bundle, capsys):
    out = tmp_path / "result.json"
    code = main(["--count", "210000", "--work", str(tmp_path / "work"), "--home", str(tmp_path / "home"),
                 "--bundle", str(starter_bundle), "--params", '{"memory_gb": 0.05}', "--seconds", "2",
                 "--warmup-seconds", "1", "--max-p50-ms", "1000", "--target-recall", "0.9", "--out", str(out),
                 "--data", str(shared_data)])
    result = json.loads(out.read_text())
    built, served = result["build"], result["serve"]
    assert code == 0, result["checks"]
    assert built["count"] == 210_000 and built["index"]["type"] == "ivf_pq" and built["index"]["refine_factor"] > 1
    assert built["tuning"]["reached"] and built["recall_at_10"] >= 0.9
    assert built["files"]["vectors.npy"] >= 210_000 * 384 * 4 and built["version_bytes"] >= sum(built["files"].values())
    assert built["peak_rss_mb"] >= built["peak_private_mb"]  # the private part is part of the resident set
    # the server searched the index through its memory map, and said so
    assert served["info"]["memory_mapped"] is True and served["info"]["count"] == 210_000
    assert served["c1"]["n"] > 0 and served["c32"]["n"] > 0
    assert served["c1"]["failures"] == 0 and served["c32"]["failures"] == 0
    for phase in ("memory_ready", "memory_first_query", "memory_loaded"):
        m = served[phase]
        assert 0 < m["private_mb"] < m["rss_mb"] and m["file_mb"] > 0
    printed = capsys.readouterr().out
    # what it prints is what it measured
    assert f"cold first query {served['cold_first_query_ms']:.0f} ms, the next {served['second_query_ms']:.0f} ms" in printed
    assert "private memory under 2.0 GB" in printed
    assert (f"peak RSS {built['peak_rss_mb'] / 1024:.2f} GB, of it private {built['peak_private_mb'] / 1024:.2f} GB" in printed)
    # started twice: hashing every file, then trusting the files verified by that start
    assert (f"ready in {served['start_s']:.1f} s, files unchanged since their last sha256 check; "
            f"{served['start_rehash_s']:.1f} s hashing every file, PARASEEK_SNAPSHOT_VERIFY=always" in printed)
    # a later run reuses the build instead of building again
    record = tmp_path / "work" / "build.json"
    stamp = record.stat().st_mtime_ns
    assert main(["--count", "210000", "--work", str(tmp_path / "work"), "--bundle", str(starter_bundle),
                 "--build-only", "--data", str(shared_data)]) == 0
    assert record.stat().st_mtime_ns == stamp
