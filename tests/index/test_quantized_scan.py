"""The quantized copy (int8 or fp16) that flat snapshots on the CPU scan (fp16: searches of a few
queries): the flat index's answers, from a quarter or half of the bytes."""

import faiss
import numpy as np
import pytest

import paraseek.index.snapshot as snapshot_module
from paraseek.index.faiss_index import search_threads, set_threads
from paraseek.index import quantized_scan
from paraseek.index.quantized_scan import (
    INT8_PRODUCTS_MODEL,
    QuantizedScan,
    int8_products_exact,
    int8_products_model,
    products_exact,
)
from paraseek.index.snapshot import Snapshot
from tests.index.test_memory_mapped import build, clustered

# the int8 copy is refused where onnxruntime's int8 product is not exact (x86 without VNNI): its tests run where
# it is, and the refusal is tested everywhere
pytestmark = pytest.mark.quick


needs_exact_int8 = pytest.mark.skipif(not int8_products_exact(), reason="onnxruntime's int8 product saturates on this CPU")
CODECS = [pytest.param("int8", marks=needs_exact_int8), "fp16"]


@pytest.mark.parametrize("codec", CODECS)
@pytest.mark.parametrize("chunks,threads", [(1, 1), (2, 2), (3, 2), (2, 1)])
def test_the_quantized_scan_answers_as_faiss_flat(chunks, threads, codec):
    rows, queries = clustered(6000, 48), clustered(3, 48, seed=5)
    flat = faiss.IndexFlatIP(48)
    flat.add(rows)
    scan = QuantizedScan(rows, codec, chunks=chunks, threads=threads)
    assert scan.nbytes == rows.nbytes // 2  # int8: the codes and onnxruntime's packed copy of them
    for q, k in [(queries, 10), (queries[:1], 1), (queries[:2], 100)]:
        scores, numbers = scan.search(q, k, threads)
        want_scores, want_numbers = flat.search(q, k)
        np.testing.assert_array_equal(numbers, want_numbers)
        # rescored from the fp32 rows: the flat index's scores, not the copy's
        np.testing.assert_allclose(scores, want_scores, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("codec", CODECS)
def test_near_ties_that_the_copy_cannot_tell_apart_are_ranked_by_the_fp32_rows(monkeypatch, codec):
    rng = np.random.default_rng(1)
    base = rng.standard_normal(32).astype(np.float32)
    # 100 rows within fp16's rounding of each other, among random ones: their fp32 order decides
    near = base + rng.standard_normal((100, 32)).astype(np.float32) * 1e-5
    rows = np.vstack([rng.standard_normal((3000, 32)).astype(np.float32), near])
    q = base[None] / np.linalg.norm(base)
    scan = QuantizedScan(rows, codec, chunks=2)
    rounds = []
    candidates = scan._copy.candidates
    monkeypatch.setattr(scan._copy, "candidates", lambda q, wanted, t: rounds.append(wanted) or candidates(q, wanted, t))
    scores, numbers = scan.search(q, 10, 2)
    # 2k + 64 = 84 candidates (a part) cannot hold 100 rows the copy scores alike: a second scan takes 336
    assert rounds == [84, 336]
    exact = rows @ q[0]
    np.testing.assert_array_equal(numbers[0], np.argsort(-exact, kind="stable")[:10])
    np.testing.assert_allclose(scores[0], np.sort(exact)[::-1][:10], rtol=1e-6)


@needs_exact_int8
def test_equal_rows_come_in_row_order_and_small_parts_give_what_they_have():
    rng = np.random.default_rng(2)
    rows = np.repeat(rng.standard_normal((4, 16)).astype(np.float32), 5, axis=0)  # each row 5 times
    q = rng.standard_normal((1, 16)).astype(np.float32)
    scores, numbers = QuantizedScan(rows, chunks=3).search(q, 12, 3)  # parts of 6-7 rows, k past them
    exact = rows @ q[0]
    np.testing.assert_array_equal(numbers[0], np.argsort(-exact, kind="stable")[:12])
    assert all(np.diff(numbers[0][scores[0] == s]).min(initial=1) > 0 for s in np.unique(scores[0]))
    # k past the collection: all of it, ranked
    assert QuantizedScan(rows, chunks=2).search(q, 50, 2)[1].shape == (1, 20)


@pytest.mark.parametrize("codec", CODECS)
def test_a_served_flat_snapshot_searches_through_the_copy(tmp_path, monkeypatch, codec):
    monkeypatch.setattr(snapshot_module, "SPLIT_SCAN_MIN_ROWS", 1000)  # the collection has 4K
    root = build(tmp_path, "flat")
    plain = Snapshot.load(root)
    plain.prepare_serving(scan_copy=None)
    served = Snapshot.load(root)
    served.prepare_serving(scan_copy=codec)
    assert plain._scan_copy is None and served._scan_copy is not None and served._scan_copy.codec == codec
    calls: list[tuple[int, int]] = []
    search = served._scan_copy.search
    monkeypatch.setattr(served._scan_copy, "search", lambda q, k, t: calls.append((len(q), t)) or search(q, k, t))
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
    if codec == "int8":  # a merged batch too (up to 8 calls' worth)
        assert calls == [(1, 1), (3, 1), (9, 1), (1, 2), (3, 2), (9, 2)]
    else:  # 4+ queries take faiss' matrix-product path
        assert calls == [(1, 1), (3, 1), (1, 2), (3, 2)]
    served.search_ids(queries[:1], quantized_scan.MAX_K + 1)  # k past the copy's bound: the fp32 rows
    assert len(calls) == (6 if codec == "int8" else 4)


@needs_exact_int8
def test_the_int8_copy_answers_a_batch_split_among_calls(monkeypatch):
    monkeypatch.setattr(quantized_scan, "_SCORES_BYTES", 8 * 6000 * 4)  # 4 queries a call over 6K rows
    rows, queries = clustered(6000, 48), clustered(10, 48, seed=11)
    scan = QuantizedScan(rows, "int8")
    assert scan._copy.queries_per_call == 4
    assert scan.max_queries == 32  # past 8 calls faiss' fp32 product over the batch reads less
    calls = []
    run = scan._copy.session.run
    monkeypatch.setattr(scan._copy.session, "run", lambda out, feeds: calls.append(len(feeds["queries"])) or run(out, feeds))
    scores, numbers = scan.search(queries, 10)
    assert calls == [8, 8, 4]  # each query's coarse and fine parts, 4 + 4 + 2 queries
    want_scores, want_numbers = faiss_flat_search(rows, queries, 10)
    np.testing.assert_array_equal(numbers, want_numbers)
    np.testing.assert_allclose(scores, want_scores, rtol=1e-6, atol=1e-6)


def faiss_flat_search(rows, queries, k):
    flat = faiss.IndexFlatIP(rows.shape[1])
    flat.add(rows)
    return flat.search(queries, k)


def test_the_shipped_int8_graph_is_the_one_int8_products_model_writes():
    assert INT8_PRODUCTS_MODEL.read_bytes() == int8_products_model()


def test_no_copy_for_small_or_approximate_snapshots_or_when_memory_is_short(tmp_path, monkeypatch, caplog):
    root = build(tmp_path, "flat")
    small = Snapshot.load(root)
    small.prepare_serving()
    assert small._scan_copy is None  # 4K rows: below SPLIT_SCAN_MIN_ROWS
    monkeypatch.setattr(snapshot_module, "SPLIT_SCAN_MIN_ROWS", 1000)
    # an int8 copy (half the rows' bytes: codes and their packed copy) would take more than a quarter of
    # what is available
    monkeypatch.setattr(snapshot_module, "available_memory_bytes", lambda: 4000 * 32 * 2 * 4 - 1)
    short = Snapshot.load(root)
    short.prepare_serving()
    codec = "int8" if int8_products_exact() else "fp16"  # the same bytes either way
    assert short._scan_copy is None and f"no {codec} copy" in caplog.text
    (tmp_path / "ivf").mkdir()
    ivf = Snapshot.load(build(tmp_path / "ivf", "ivf_flat"))
    ivf.prepare_serving()
    assert ivf._scan_copy is None


def test_vectors_beyond_fp16s_range_get_no_fp16_copy_and_an_unknown_codec_is_refused():
    with pytest.raises(ValueError, match="beyond fp16's range"):
        QuantizedScan(np.full((10, 4), 1e5, np.float32), "fp16")
    if int8_products_exact():
        assert QuantizedScan(np.full((10, 4), 1e5, np.float32), "int8").nbytes == 80  # int8 takes any range
    with pytest.raises(ValueError, match="codec 'int4'"):
        QuantizedScan(np.ones((10, 4), np.float32), "int4")  # type: ignore[arg-type]


def test_the_error_bound_holds_for_every_row_and_is_tight_enough_to_spare_rescans():
    """The bound is what exactness rests on: no row's copy score may differ from its fp32 score by
    more than it says. It must also not be so loose that every query scans twice."""
    rows, queries = clustered(6000, 48), clustered(20, 48, seed=9)
    for codec in ("int8", "fp16") if int8_products_exact() else ("fp16",):
        scan = QuantizedScan(rows, codec, chunks=2)
        bound = scan.score_error(queries)
        if codec == "int8":
            approx, found = scan._copy.best(queries, len(rows))  # every row's copy score, per query
            exact = np.take_along_axis(queries @ rows.T, found, axis=1)
            assert (np.abs(approx - exact) <= bound[:, None]).all(), codec
        else:
            for begin, part in scan._copy.parts:
                approx, found = part.search(queries, part.ntotal)
                exact = np.take_along_axis(queries @ rows[begin:begin + part.ntotal].T, found, axis=1)
                assert (np.abs(approx - exact) <= bound[:, None]).all(), codec
        spread = np.ptp(queries @ rows.T, axis=1)
        assert (bound < 0.05 * spread).all(), codec  # a small fraction of the scores' range


@needs_exact_int8
@pytest.mark.parametrize("among", ["broad", "first half", "all", "few"])
def test_a_search_among_some_rows_answers_as_an_exact_scan_of_them(among):
    rows, queries = clustered(6000, 32), clustered(3, 32, seed=7)
    chosen = {"broad": np.flatnonzero(np.random.default_rng(3).random(6000) < 0.6),
              "first half": np.arange(2500),  # the second part has none of them
              "all": np.arange(6000), "few": np.array([5, 4000, 5999])}[among]
    scores, numbers = QuantizedScan(rows, chunks=2).search(queries, 10, 2, among=chosen)
    exact = queries @ rows[chosen].T
    best = np.argsort(-exact, axis=1, kind="stable")[:, :10]
    np.testing.assert_array_equal(numbers, chosen[best])
    np.testing.assert_allclose(scores, np.take_along_axis(exact, best, axis=1), rtol=1e-5, atol=1e-6)
    assert QuantizedScan(rows, chunks=2).search(queries, 10, 2, among=np.array([], np.int64))[1].shape == (3, 0)


@needs_exact_int8
def test_a_broad_filter_on_a_served_flat_snapshot_scans_the_copy(tmp_path, monkeypatch):
    from paraseek.index.filters import SearchFilter

    monkeypatch.setattr(snapshot_module, "SPLIT_SCAN_MIN_ROWS", 1000)  # the collection has 4K
    root = build(tmp_path, "flat")  # ids 500 + 3i, cameras cam0..cam3 in turn
    plain, served = Snapshot.load(root), Snapshot.load(root)
    served.prepare_serving()
    calls: list[int] = []
    search = served._scan_copy.search
    monkeypatch.setattr(served._scan_copy, "search", lambda q, k, t, among=None: calls.append(len(among)) or search(q, k, t, among))
    queries = clustered(4, 32, seed=4)
    broad = SearchFilter(id_range={"lt": 500 + 3 * 3000})  # 3,000 of 4,000: every row is read either way
    narrow = SearchFilter(fields={"camera": "cam1"})  # 1,000: gathered and scanned in fp32
    for flt in (broad, narrow):
        for q, k in ((queries[:1], 10), (queries[:3], 5), (queries, 10), (queries[:1], quantized_scan.MAX_K + 1)):
            scores, ids = served.filtered(flt).search_ids(q, k)
            want_scores, want_ids = plain.filtered(flt).search_ids(q, k)
            np.testing.assert_array_equal(ids, want_ids)
            np.testing.assert_allclose(scores, want_scores, rtol=1e-5, atol=1e-6)
    assert calls == [3000, 3000, 3000]  # the int8 copy: any number of queries with k up to MAX_K, broad filter only


def saturating_products(queries: np.ndarray, codes: np.ndarray) -> np.ndarray:
    """What a u8 x s8 kernel without VNNI computes (pmaddubsw): each pair of products added in int16, saturated;
    then the zero point's share taken off and the coarse and fine halves summed, as the graph does."""
    a, b = queries.astype(np.int64), codes.astype(np.int64)
    pairs = a[:, None, 0::2] * b.T[None, :, 0::2] + a[:, None, 1::2] * b.T[None, :, 1::2]
    raw = np.clip(pairs, -32768, 32767).sum(axis=2) - 128 * b.sum(axis=0)[None, :]
    half = len(queries) // 2
    return raw[:half] + raw[half:]


def exact_products(queries: np.ndarray, codes: np.ndarray) -> np.ndarray:
    raw = (queries.astype(np.int64) - 128) @ codes.astype(np.int64)
    return raw[: len(queries) // 2] + raw[len(queries) // 2:]


def test_a_saturating_int8_kernel_is_told_from_an_exact_one_and_its_copy_refused(tmp_path, monkeypatch, caplog):
    assert products_exact(exact_products) and not products_exact(saturating_products)
    monkeypatch.setattr(quantized_scan, "int8_products_exact", lambda: False)
    monkeypatch.setattr(snapshot_module, "int8_products_exact", lambda: False)
    with pytest.raises(ValueError, match="not exact on this CPU"):
        QuantizedScan(clustered(100, 16), "int8")
    monkeypatch.setattr(snapshot_module, "SPLIT_SCAN_MIN_ROWS", 1000)  # the collection has 4K
    served = Snapshot.load(build(tmp_path, "flat"))
    served.prepare_serving()  # int8 asked for: fp16 instead, whose bound holds on any CPU
    assert served._scan_copy is not None and served._scan_copy.codec == "fp16"
    assert "not exact on this CPU" in caplog.text
