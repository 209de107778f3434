"""The backend benchmark runs end to end on a small collection and prints both backends side by side."""

import pytest

from paraseek.loadtests.bench_backends import SELECTIVITY, main


def test_bench_backends_measures_both_backends_and_prints_ratios(shared_data, capsys):
    results = main(["--size", "3000", "--calls", "5", "--settle", "0", "--kinds", "flat", "hnsw", "--data", str(shared_data)])
    assert set(results) == {("faiss", "flat"), ("milvus", "flat"), ("faiss", "hnsw"), ("milvus", "hnsw")}
    for (backend, kind), r in results.items():
        assert r["short"] == 0, r  # every filter keeps more than 10 vectors: every answer has 10 hits
        if kind == "flat":  # exact search on both: recall 1 unfiltered and at every selectivity
            # Milvus' FLAT sums in an order of its own: a near-tie at the tenth place may swap with the next
            # (one of 5,000 results on an AVX2-only EPYC)
            least = 1.0 if backend == "faiss" else 0.999
            assert min(r["recall"], *(r[f"{n}_recall"] for n in SELECTIVITY)) >= least, r
        else:
            assert r["recall"] >= 0.9
    out = capsys.readouterr().out
    # the printed table has a row per measurement and the ratio table a row per index kind
    printed = [line.split()[:2] for line in out.split("Milvus / FAISS")[0].splitlines()]
    assert all([b, k] in printed for b, k in results)
    # the ratio table is Milvus's numbers over FAISS's, kind by kind, from the measurements returned
    ratios = {line.split()[0]: [float(x) for x in line.split()[1:]] for line in out.split("Milvus / FAISS")[1].splitlines()[2:] if line.strip()}
    assert set(ratios) == {"flat", "hnsw"}
    for kind, row in ratios.items():
        f, m = results[("faiss", kind)], results[("milvus", kind)]
        keys = ["build_s", "b1_ms", "b64_qps", *(f"{n}_ms" for n in SELECTIVITY), "poll_ms", "manifest_ms"]
        assert row == [pytest.approx(m[k] / f[k], abs=0.051 if k != "b64_qps" else 0.0051) for k in keys], (kind, row)
