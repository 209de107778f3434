"""The backend benchmark runs end to end on a small collection and prints both backends side by side."""

from paraseek.loadtests.bench_backends import main


def test_bench_backends_prints_both_backends_and_ratios(shared_data, capsys):
    main(["--size", "3000", "--calls", "5", "--kinds", "flat", "hnsw", "--data", str(shared_data)])
    out = capsys.readouterr().out
    rows = {tuple(line.split()[:2]): line.split() for line in out.splitlines() if line.split()[:1] in (["faiss"], ["milvus"])}
    assert set(rows) == {("faiss", "flat"), ("milvus", "flat"), ("faiss", "hnsw"), ("milvus", "hnsw")}
    for backend in ("faiss", "milvus"):
        flat = rows[(backend, "flat")]
        # exact search on both: recall 1 unfiltered and at every selectivity
        assert float(flat[3]) == 1.0 and [float(flat[i]) for i in (7, 9, 11)] == [1.0, 1.0, 1.0]
    ratios = out.split("Milvus / FAISS")[1].splitlines()
    assert any(line.startswith("flat") for line in ratios) and any(line.startswith("hnsw") for line in ratios)
