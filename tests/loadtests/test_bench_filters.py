"""loadtests/bench_filters.py on a small IVF snapshot: both selectors measured, the filtered lists inside the filter."""

import numpy as np

from paraseek.index.builder import build_snapshot_from_vectors
from paraseek.index.faiss_index import IndexSpec
from paraseek.loadtests import bench_filters


def test_bench_filters_measures_both_selectors_on_an_ivf_snapshot(shared_data, tmp_path, capsys):
    rng = np.random.default_rng(0)
    vectors = rng.standard_normal((120_000, 384)).astype(np.float32)
    np.save(tmp_path / "vectors.npy", vectors / np.linalg.norm(vectors, axis=1, keepdims=True))
    build_snapshot_from_vectors(tmp_path / "vectors.npy", tmp_path / "snap", image_space="test/space",
                                spec=IndexSpec(type="ivf_flat", nlist=64, nprobe=64), progress=False)
    code = bench_filters.main(["--snapshot", str(tmp_path / "snap"), "--data", str(shared_data), "--rounds", "2"])
    out = capsys.readouterr().out
    assert code == 0, out  # every filtered result inside its filter
    rows = [line.split() for line in out.splitlines() if line.strip().startswith(("50%", "10%", "1%"))]
    # per share: the two selectors, then the bitmap with the unfiltered setting
    assert [(r[0], r[3]) for r in rows] == [(s, k) for s in ("50%", "10%", "1%") for k in ("bitmap", "hash", "bitmap")]
    lines = [line for line in out.splitlines() if line.strip().startswith(("50%", "10%", "1%"))]
    assert all("nprobe 64" in line for line in lines[:3])  # 60,000 matches: the ANN search, every list already
    assert all("exact scan" in line for line in lines[3:])  # 12,000 and 1,200: a scan of the matches
    assert rows[0][1] == "60,000"
    assert all(r[-1] == "1.000" for r in rows)  # every list probed: the exact filtered top 10
