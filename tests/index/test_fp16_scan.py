"""The fp16 copy that flat snapshots on the CPU scan for searches of a few queries: the flat index's
answers, from half the bytes."""

import faiss
import numpy as np
import pytest

import paraseek.index.snapshot as snapshot_module
from paraseek.index.faiss_index import search_threads, set_threads
from paraseek.index import fp16_scan
from paraseek.index.fp16_scan import Fp16Scan
from paraseek.index.snapshot import Snapshot
from tests.index.test_memory_mapped import build, clustered


@pytest.mark.parametrize("chunks,threads", [(1, 1), (2, 2), (3, 2), (2, 1)])
def test_the_fp16_scan_answers_as_faiss_flat(chunks, threads):
    rows, queries = clustered(6000, 48), clustered(3, 48, seed=5)
    flat = faiss.IndexFlatIP(48)
    flat.add(rows)
    scan = Fp16Scan(rows, chunks=chunks)
    assert scan.nbytes == rows.nbytes // 2
    for q, k in [(queries, 10), (queries[:1], 1), (queries[:2], 100)]:
        scores, numbers = scan.search(q, k, threads)
        want_scores, want_numbers = flat.search(q, k)
        np.testing.assert_array_equal(numbers, want_numbers)
        # rescored from the fp32 rows: the flat index's scores, not the fp16 copy's
        np.testing.assert_allclose(scores, want_scores, rtol=1e-6, atol=1e-6)


def test_near_ties_that_fp16_cannot_tell_apart_are_ranked_by_the_fp32_rows(monkeypatch):
    rng = np.random.default_rng(1)
    base = rng.standard_normal(32).astype(np.float32)
    # 50 rows within fp16's rounding of each other, among random ones: their fp32 order decides
    near = base + rng.standard_normal((50, 32)).astype(np.float32) * 1e-5
    rows = np.vstack([rng.standard_normal((3000, 32)).astype(np.float32), near])
    q = base[None] / np.linalg.norm(base)
    scan = Fp16Scan(rows, chunks=2)
    rounds = []
    candidates = fp16_scan._candidates
    monkeypatch.setattr(fp16_scan, "_candidates", lambda p, q, wanted, t: rounds.append(wanted) or candidates(p, q, wanted, t))
    scores, numbers = scan.search(q, 10, 2)
    # 40 candidates a part cannot hold 50 rows fp16 scores alike: a second scan takes 160
    assert rounds == [40, 160]
    exact = rows @ q[0]
    np.testing.assert_array_equal(numbers[0], np.argsort(-exact, kind="stable")[:10])
    np.testing.assert_allclose(scores[0], np.sort(exact)[::-1][:10], rtol=1e-6)


def test_equal_rows_come_in_row_order_and_small_parts_give_what_they_have():
    rng = np.random.default_rng(2)
    rows = np.repeat(rng.standard_normal((4, 16)).astype(np.float32), 5, axis=0)  # each row 5 times
    q = rng.standard_normal((1, 16)).astype(np.float32)
    scores, numbers = Fp16Scan(rows, chunks=3).search(q, 12, 3)  # parts of 6-7 rows, k past them
    exact = rows @ q[0]
    np.testing.assert_array_equal(numbers[0], np.argsort(-exact, kind="stable")[:12])
    assert all(np.diff(numbers[0][scores[0] == s]).min(initial=1) > 0 for s in np.unique(scores[0]))
    # k past the collection: all of it, ranked
    assert Fp16Scan(rows, chunks=2).search(q, 50, 2)[1].shape == (1, 20)


def test_a_served_flat_snapshot_searches_a_few_queries_through_the_copy(tmp_path, monkeypatch):
    monkeypatch.setattr(snapshot_module, "SPLIT_SCAN_MIN_ROWS", 1000)  # the collection has 4K
    root = build(tmp_path, "flat")
    plain = Snapshot.load(root)
    plain.prepare_serving(fp16_scan=False)
    served = Snapshot.load(root)
    served.prepare_serving(fp16_scan=True)
    assert plain._fp16 is None and served._fp16 is not None
    calls: list[tuple[int, int]] = []
    search = served._fp16.search
    monkeypatch.setattr(served._fp16, "search", lambda q, k, t: calls.append((len(q), t)) or search(q, k, t))
    queries = clustered(9, 32, seed=2)
    before = search_threads()
    try:
        for threads in (1, 2):
            set_threads(threads)
            for q in (queries[:1], queries[:3], queries):
                scores, ids = served.search_ids(q, 10)
                want_scores, want_ids = plain.search_ids(q, 10)
                np.testing.assert_array_equal(ids, want_ids)
                np.testing.assert_allclose(scores, want_scores, rtol=1e-5, atol=1e-6)
    finally:
        set_threads(before)
    # 4+ queries take faiss' matrix-product path; k past the copy's bound too
    assert calls == [(1, 1), (3, 1), (1, 2), (3, 2)]
    served.search_ids(queries[:1], fp16_scan.MAX_K + 1)
    assert len(calls) == 4


def test_no_copy_for_small_or_approximate_snapshots_or_when_memory_is_short(tmp_path, monkeypatch, caplog):
    root = build(tmp_path, "flat")
    small = Snapshot.load(root)
    small.prepare_serving(fp16_scan=True)
    assert small._fp16 is None  # 4K rows: below SPLIT_SCAN_MIN_ROWS
    monkeypatch.setattr(snapshot_module, "SPLIT_SCAN_MIN_ROWS", 1000)
    monkeypatch.setattr(snapshot_module, "available_memory_bytes", lambda: 4000 * 32 * 4 * 0.5 * 4 - 1)
    short = Snapshot.load(root)
    short.prepare_serving(fp16_scan=True)
    assert short._fp16 is None and "no fp16 copy" in caplog.text
    (tmp_path / "ivf").mkdir()
    ivf = Snapshot.load(build(tmp_path / "ivf", "ivf_flat"))
    ivf.prepare_serving(fp16_scan=True)
    assert ivf._fp16 is None


def test_vectors_beyond_fp16s_range_get_no_copy():
    with pytest.raises(ValueError, match="beyond fp16's range"):
        Fp16Scan(np.full((10, 4), 1e5, np.float32))


@pytest.mark.parametrize("among", ["broad", "first half", "all", "few"])
def test_a_search_among_some_rows_answers_as_an_exact_scan_of_them(among):
    rows, queries = clustered(6000, 32), clustered(3, 32, seed=7)
    chosen = {"broad": np.flatnonzero(np.random.default_rng(3).random(6000) < 0.6),
              "first half": np.arange(2500),  # the second part has none of them
              "all": np.arange(6000), "few": np.array([5, 4000, 5999])}[among]
    scores, numbers = Fp16Scan(rows, chunks=2).search(queries, 10, 2, among=chosen)
    exact = queries @ rows[chosen].T
    best = np.argsort(-exact, axis=1, kind="stable")[:, :10]
    np.testing.assert_array_equal(numbers, chosen[best])
    np.testing.assert_allclose(scores, np.take_along_axis(exact, best, axis=1), rtol=1e-5, atol=1e-6)
    assert Fp16Scan(rows, chunks=2).search(queries, 10, 2, among=np.array([], np.int64))[1].shape == (3, 0)


def test_a_broad_filter_on_a_served_flat_snapshot_scans_the_copy(tmp_path, monkeypatch):
    from paraseek.index.filters import SearchFilter

    monkeypatch.setattr(snapshot_module, "SPLIT_SCAN_MIN_ROWS", 1000)  # the collection has 4K
    root = build(tmp_path, "flat")  # ids 500 + 3i, cameras cam0..cam3 in turn
    plain, served = Snapshot.load(root), Snapshot.load(root)
    served.prepare_serving(fp16_scan=True)
    calls: list[int] = []
    search = served._fp16.search
    monkeypatch.setattr(served._fp16, "search", lambda q, k, t, among=None: calls.append(len(among)) or search(q, k, t, among))
    queries = clustered(4, 32, seed=4)
    broad = SearchFilter(id_range={"lt": 500 + 3 * 3000})  # 3,000 of 4,000: every row is read either way
    narrow = SearchFilter(fields={"camera": "cam1"})  # 1,000: gathered and scanned in fp32
    for flt in (broad, narrow):
        for q, k in ((queries[:1], 10), (queries[:3], 5), (queries, 10), (queries[:1], fp16_scan.MAX_K + 1)):
            scores, ids = served.filtered(flt).search_ids(q, k)
            want_scores, want_ids = plain.filtered(flt).search_ids(q, k)
            np.testing.assert_array_equal(ids, want_ids)
            np.testing.assert_allclose(scores, want_scores, rtol=1e-5, atol=1e-6)
    assert calls == [3000, 3000]  # 1-3 queries with k up to MAX_K, broad filter only
