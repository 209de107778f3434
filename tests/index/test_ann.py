"""Approximate search that holds recall: the refine stage and tuning for a target recall."""

from __future__ import annotations

import faiss
import numpy as np
import pytest

from paraseek.core.rank_metrics import overlap_recall
from paraseek.index.builder import build_snapshot_from_vectors
from paraseek.index.faiss_index import ExactVectors, IndexSpec, apply_search_params, create_index, exact_search, search, train_and_add
from paraseek.index.faiss_index import id_selector, search_parameters, search_threads, set_threads, split_scan, tune_for_recall
from paraseek.index.snapshot import Snapshot
from paraseek.index.recall import split_recall_queries


def _clustered(n: int, dim: int, seed: int, centres: int = 64, noise: float = 0.6) -> np.ndarray:
    rng = np.random.default_rng(seed)
    c = rng.standard_normal((centres, dim)).astype(np.float32)
    x = c[rng.integers(0, centres, n)] + noise * rng.standard_normal((n, dim)).astype(np.float32)
    return x / np.linalg.norm(x, axis=1, keepdims=True)


@pytest.fixture(scope="module")
def collection():
    vectors = _clustered(20_000, 64, seed=0)
    ids = np.arange(20_000, dtype=np.int64) * 7 + 3  # ids are not row numbers
    # "text" queries: drawn around the same centres, shifted off the collection's distribution
    queries = _clustered(200, 64, seed=0, noise=0.9)[:200]
    queries = queries + 0.3 * _clustered(1, 64, seed=5)[0]
    queries /= np.linalg.norm(queries, axis=1, keepdims=True)
    return vectors, ids, queries.astype(np.float32), exact_search(vectors, ids, queries, 10)


@pytest.mark.quick
def test_rerank_is_exact_among_the_candidates(collection):
    vectors, ids, queries, _ = collection
    exact = ExactVectors(vectors, ids)
    rng = np.random.default_rng(1)
    candidates = ids[rng.integers(0, len(ids), (5, 40))]
    candidates[0, 5:] = -1  # a short candidate list is padded with -1
    scores, got = exact.rerank(queries[:5], candidates, 10)
    for q in range(5):
        cand = [c for c in candidates[q] if c >= 0]
        sims = {c: float(vectors[(c - 3) // 7] @ queries[q]) for c in cand}
        expected = sorted(sims, key=lambda c: -sims[c])[:10]
        assert [int(x) for x in got[q] if x >= 0] == expected
        assert np.allclose([s for s, x in zip(scores[q], got[q]) if x >= 0], [sims[c] for c in expected], atol=1e-5)
    assert (got[0, 5:] == -1).all()
    with pytest.raises(KeyError):
        exact.rows(np.array([4]))


def test_refine_recovers_the_recall_pq_codes_lose(collection):
    vectors, ids, queries, truth = collection
    spec = IndexSpec(type="ivf_pq", nlist=64, nprobe=16, pq_m=8).resolved(len(ids), 64)
    assert spec.refine_factor == 20  # ivf_pq refines by default
    index = train_and_add(create_index(spec, 64), vectors, ids)
    exact = ExactVectors(vectors, ids)
    _, plain = search(index, spec.model_copy(update={"refine_factor": 1}), queries, 10, exact)
    scores, refined = search(index, spec, queries, 10, exact)
    assert overlap_recall(refined, truth) >= overlap_recall(plain, truth) + 0.2
    # refined scores are exact inner products, not PQ estimates
    rows = exact.rows(refined[0])
    assert np.allclose(scores[0], vectors[rows] @ queries[0], atol=1e-5)


@pytest.mark.parametrize("kind", ["ivf_flat", "ivf_fp16", "ivf_pq", "hnsw"])
@pytest.mark.quick
def test_tuning_picks_the_cheapest_setting_that_reaches_the_target(collection, kind):
    vectors, ids, queries, truth = collection
    params = {"ivf_flat": {"nlist": 128}, "ivf_fp16": {"nlist": 128}, "ivf_pq": {"nlist": 128, "pq_m": 8},
              "hnsw": {"hnsw_m": 8, "ef_construction": 40}}
    spec = IndexSpec(type=kind, **params[kind]).resolved(len(ids), 64)
    index = train_and_add(create_index(spec, 64), vectors, ids)
    exact = ExactVectors(vectors, ids)
    tuned, recall, _ = tune_for_recall(index, spec, exact, queries, truth, 0.95)
    assert recall >= 0.95
    _, got = search(index, tuned, queries, 10, exact)
    assert overlap_recall(got, truth) == pytest.approx(recall)  # the index is left on the chosen setting
    if kind in ("ivf_flat", "ivf_fp16"):  # one step cheaper misses the target
        smaller = max(p for p in (1, 2, 4, 8, 16, 24, 32, 48, 64, 96) if p < tuned.nprobe)
        apply_search_params(index, tuned.model_copy(update={"nprobe": smaller}))
        assert overlap_recall(index.search(queries, 10)[1], truth) < 0.95


@pytest.mark.quick
def test_ivf_fp16_holds_half_the_bytes_and_scores_like_ivf_flat(collection):
    vectors, ids, queries, truth = collection
    built = {}
    for kind in ("ivf_flat", "ivf_fp16"):
        spec = IndexSpec(type=kind, nlist=64, nprobe=64).resolved(len(ids), 64)  # every list: exhaustive
        built[kind] = train_and_add(create_index(spec, 64), vectors, ids)
    flat_ivf, fp16_ivf = (faiss.extract_index_ivf(built[k]) for k in ("ivf_flat", "ivf_fp16"))
    assert (flat_ivf.code_size, fp16_ivf.code_size) == (4 * 64, 2 * 64)
    scores, got = built["ivf_fp16"].search(queries, 10)
    assert overlap_recall(got, truth) >= 0.99  # ties within fp16 rounding may swap a neighbour
    rows = ExactVectors(vectors, ids).rows(got[0])
    assert np.allclose(scores[0], vectors[rows] @ queries[0], atol=2e-3)  # fp16 keeps ~3 significant digits


def test_build_with_target_recall_records_and_serves_the_setting(collection, tmp_path):
    vectors, ids, queries, truth = collection
    src = tmp_path / "vecs.npy"
    np.save(src, vectors)
    res = build_snapshot_from_vectors(src, tmp_path / "snap", image_space="test/space", progress=False,
                                      spec=IndexSpec(type="ivf_pq", nlist=128, pq_m=8), target_recall=0.95, queries=queries)
    m = res.manifest
    assert m.tuning is not None and m.tuning["target_recall"] == 0.95 and m.tuning["reached"]
    assert m.tuning["tuning_queries"] == 100 and m.recall_queries == 100  # held-out half measures the recorded recall
    assert m.tuning["setting"] == {"nprobe": m.index.nprobe, "ef_search": m.index.ef_search,
                                   "refine_factor": m.index.refine_factor}
    assert m.recall_at_10 is not None and m.recall_at_10 >= 0.9
    snap = Snapshot.load(tmp_path / "snap")
    assert faiss.extract_index_ivf(snap.index).nprobe == m.index.nprobe
    _, held_out = split_recall_queries(len(queries))
    _, got = snap.search_ids(queries[held_out], 10)
    truth_rows = exact_search(vectors, np.arange(len(vectors), dtype=np.int64), queries[held_out], 10)
    assert overlap_recall(got, truth_rows) == pytest.approx(m.recall_at_10)  # the served search is the measured one


@pytest.mark.quick
def test_cli_target_recall_with_query_vectors(collection, tmp_path):
    from typer.testing import CliRunner

    from paraseek.cli import app

    vectors, _, queries, _ = collection
    np.save(tmp_path / "vecs.npy", vectors[:5000])
    np.save(tmp_path / "queries.npy", queries)
    r = CliRunner().invoke(app, ["index", "build", "--embeddings", str(tmp_path / "vecs.npy"), "--image-space", "test/space",
                                 "--out", str(tmp_path / "snap"), "--type", "ivf_flat", "--params", '{"nlist": 64}',
                                 "--target-recall", "0.9", "--query-vectors", str(tmp_path / "queries.npy")])
    assert r.exit_code == 0, r.output
    assert "tuned for recall@10 >= 0.9 on 100 queries (the query vectors given)" in r.output
    np.save(tmp_path / "bad.npy", queries[:, :10])
    bad = CliRunner().invoke(app, ["index", "build", "--embeddings", str(tmp_path / "vecs.npy"), "--image-space", "s",
                                   "--out", str(tmp_path / "snap2"), "--type", "ivf_flat", "--target-recall", "0.9",
                                   "--query-vectors", str(tmp_path / "bad.npy")])
    assert bad.exit_code != 0 and "query vectors have shape (200, 10)" in bad.output


@pytest.mark.parametrize("n_queries", [1, 4, 32, 256, 257, 2_000])
def test_exact_search_is_exact_at_every_block_size_and_keeps_the_score_buffer_small(n_queries):
    """Merged serving batches use tall collection blocks, large query sets faiss' default; either way
    the ids match a plain matrix product and the score block stays at faiss' default 16 MB."""
    rng = np.random.default_rng(n_queries)
    base = rng.standard_normal((20_000, 32), dtype=np.float32)
    queries = rng.standard_normal((n_queries, 32), dtype=np.float32)
    index = create_index(IndexSpec(type="flat"), 32)
    train_and_add(index, base, np.arange(len(base)) + 7)
    _, ids = search(index, IndexSpec(type="flat").resolved(len(base), 32), queries, 5)
    expected = np.argsort(-(queries @ base.T), axis=1)[:, :5] + 7
    assert (ids == expected).mean() > 0.999  # float ties aside
    assert faiss.cvar.distance_compute_blas_query_bs * faiss.cvar.distance_compute_blas_database_bs <= 4096 * 1024


@pytest.mark.parametrize("parts", [2, 3])
@pytest.mark.parametrize("n_queries", [1, 3])
@pytest.mark.quick
def test_split_scan_finds_what_one_scan_finds(parts, n_queries):
    rng = np.random.default_rng(parts * 10 + n_queries)
    rows = rng.standard_normal((10_001, 32), dtype=np.float32)
    queries = rng.standard_normal((n_queries, 32), dtype=np.float32)
    scores, numbers = split_scan(rows, queries, 5, parts)
    products = queries @ rows.T
    expected = np.argsort(-products, axis=1)[:, :5]
    assert (numbers == expected).all()
    assert np.allclose(scores, np.take_along_axis(products, expected, axis=1), atol=1e-4)
    # parts smaller than k: each part gives what it has, the merge still keeps the top k overall
    scores, numbers = split_scan(rows[:7], queries, 5, 3)
    assert (numbers == np.argsort(-(queries @ rows[:7].T), axis=1)[:, :5]).all()


@pytest.mark.quick
def test_a_flat_snapshot_splits_a_few_queries_scan_among_its_threads(collection, tmp_path, monkeypatch):
    """With one thread set for the calling thread a flat snapshot searches as faiss does; with more, a
    search of 1-3 queries splits the collection among them, with the same answer."""
    import paraseek.index.snapshot as snapshot_module

    vectors, _, queries, _ = collection
    src = tmp_path / "vecs.npy"
    np.save(src, vectors)
    build_snapshot_from_vectors(src, tmp_path / "snap", image_space="test/space", progress=False, spec=IndexSpec(type="flat"))
    snap = Snapshot.load(tmp_path / "snap")
    calls: list[int] = []
    monkeypatch.setattr(snapshot_module, "split_scan", lambda *a: calls.append(a[3]) or split_scan(*a))
    monkeypatch.setattr(snapshot_module, "SPLIT_SCAN_MIN_ROWS", 10_000)  # the collection has 20K
    before = search_threads()
    try:
        set_threads(1)
        one = [snap.search_ids(queries[:n], 10) for n in (1, 3, 4)]
        assert calls == []
        set_threads(2)
        split = [snap.search_ids(queries[:n], 10) for n in (1, 3, 4)]
        assert calls == [2, 2]  # 4 queries take faiss' matrix-product path instead
    finally:
        set_threads(before)
    for (s1, i1), (s2, i2) in zip(one, split):
        assert (i1 == i2).all() and np.allclose(s1, s2, atol=1e-5)
    assert (split[1][1] == exact_search(vectors, np.arange(len(vectors), dtype=np.int64), queries[:3], 10)).all()


@pytest.mark.quick
def test_a_single_query_searches_on_one_openmp_thread_and_the_setting_is_restored():
    """One query gains nothing from an OpenMP team (faiss shares a search out by query), whose idle
    thread would then spin on a core the next encoder call needs."""
    rng = np.random.default_rng(0)
    base = rng.standard_normal((1_000, 16), dtype=np.float32)
    flat = create_index(IndexSpec(type="flat"), 16)
    train_and_add(flat, base, np.arange(len(base)))
    seen: list[int] = []

    class Recording:  # the index, noting the calling thread's OpenMP setting at each search
        ntotal = flat.ntotal

        def search(self, queries, k, params=None):
            seen.append(search_threads())
            return flat.search(queries, k, params=params)

    before = search_threads()
    try:
        set_threads(2)
        spec = IndexSpec(type="flat").resolved(len(base), 16)
        for n in (1, 2):
            search(Recording(), spec, base[:n], 5)
        assert seen == [1, 2] and search_threads() == 2
    finally:
        set_threads(before)


@pytest.mark.quick
def test_auto_is_exact_up_to_the_limit_then_ivf_fp16_while_its_lists_fit_then_ivf_pq(monkeypatch):
    from paraseek.index import faiss_index
    from paraseek.index.faiss_index import EXACT_LIMIT, auto_index_type

    assert auto_index_type(EXACT_LIMIT, 384) == "flat"
    assert auto_index_type(EXACT_LIMIT + 1, 384, memory_gb=1) == "ivf_fp16"  # 154 MB of float16 lists
    assert auto_index_type(10_000_000, 384, memory_gb=2) == "ivf_pq"  # 7.7 GB of lists would not fit
    # the default budget: half of what the machine has available
    monkeypatch.setattr(faiss_index, "available_memory_bytes", lambda: 12 * 2**30)  # a 6 GiB budget
    assert auto_index_type(10_000_000, 384) == "ivf_pq" and auto_index_type(5_000_000, 384) == "ivf_fp16"
    spec = IndexSpec(memory_gb=1).resolved(1_000_000, 384)  # 768 MB: fits
    assert spec.type == "ivf_fp16" and spec.nlist == 4000 and spec.refine_factor == 1
    spec = IndexSpec(memory_gb=0.5).resolved(1_000_000, 384)
    assert spec.type == "ivf_pq" and spec.pq_m == 96 and spec.refine_factor == 20


def test_auto_past_the_exact_limit_is_tuned_to_the_default_recall_without_flags(collection, tmp_path, monkeypatch):
    from paraseek.index import faiss_index
    from paraseek.index.faiss_index import AUTO_TARGET_RECALL

    vectors, ids, queries, _ = collection
    monkeypatch.setattr(faiss_index, "EXACT_LIMIT", 5_000)  # the 20K collection stands in for a large one
    src = tmp_path / "vecs.npy"
    np.save(src, vectors)
    m = build_snapshot_from_vectors(src, tmp_path / "snap", image_space="test/space", progress=False,
                                    queries=queries).manifest
    assert m.index.type == "ivf_fp16"
    assert m.tuning is not None and m.tuning["target_recall"] == AUTO_TARGET_RECALL and m.tuning["reached"]
    assert m.recall_at_10 >= 0.9
    # an explicit type is not tuned unless asked
    m = build_snapshot_from_vectors(src, tmp_path / "snap2", image_space="test/space", progress=False, queries=queries,
                                    spec=IndexSpec(type="ivf_flat")).manifest
    assert m.tuning is None


@pytest.mark.parametrize("kind", ["flat", "ivf_flat"])
@pytest.mark.parametrize("ids_of", ["rows", "offset", "sparse", "negative"])
@pytest.mark.quick
def test_id_selector_accepts_exactly_its_ids_as_a_bitmap_or_a_hash_set(kind, ids_of):
    """Small non-negative ids get a bitmap, far-apart or negative ones faiss' hash set; a filtered
    search returns the same ids either way, all of them selected."""
    rng = np.random.default_rng(3)
    vectors = rng.standard_normal((2000, 16)).astype(np.float32)
    vectors /= np.linalg.norm(vectors, axis=1, keepdims=True)
    ids = {"rows": np.arange(2000), "offset": np.arange(2000) + 5000, "sparse": np.arange(2000) * 10**12,
           "negative": np.arange(2000) - 1000}[ids_of].astype(np.int64)
    spec = IndexSpec(type=kind, nlist=16, nprobe=16) if kind != "flat" else IndexSpec(type="flat")
    index = train_and_add(create_index(spec, 16), vectors, ids)
    chosen = np.sort(rng.choice(ids, 700, replace=False))
    selector = id_selector(chosen)
    expected = faiss.IDSelectorBitmap if ids_of in ("rows", "offset") else faiss.IDSelectorBatch
    assert isinstance(selector, expected)
    _, got = search(index, spec, vectors[:20], 10, params=search_parameters(spec, selector))
    _, reference = search(index, spec, vectors[:20], 10, params=search_parameters(spec, faiss.IDSelectorBatch(chosen)))
    assert np.isin(got, chosen).all() and np.array_equal(got, reference)
    truth = chosen[np.argsort(-(vectors[:20] @ vectors[np.searchsorted(ids, chosen)].T), axis=1)[:, :10]]
    assert np.array_equal(got, truth)  # every list probed / exact: the filtered top 10 itself
