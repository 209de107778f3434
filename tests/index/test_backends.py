"""The two index backends behind one interface: filters against brute force, atomic publication,
builds that fail or are killed midway, updates and copies between backends."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest
from pydantic import ValidationError

from paraseek.index.builder import copy_snapshot, update_snapshot
from paraseek.index.versions import VersionDraft
from paraseek.index.faiss_index import IndexSpec
from paraseek.index.filters import FilterError, SearchFilter, caption_text, licence_id
from paraseek.index.snapshot import FaissStore
from paraseek.index.versions import BundleRef, SnapshotError
from paraseek.index.store import SnapshotStore
from tests.conftest import MILVUS_SERVER, fresh_prefix

BOTH_BACKENDS = True
ON_MILVUS_SERVER = True  # and on a real Milvus 2.3.5 standalone server (the run's shared one)
REF = BundleRef(name="synthetic", version="1", image_space="test/space")
WORDS = ["dog", "cat", "beach", "red car", "50% off", "snake_case", 'a "quoted" word', "Ünïcode"]


def synthetic(n: int = 3000, dim: int = 32, seed: int = 0):
    rng = np.random.default_rng(seed)
    vectors = rng.standard_normal((n, dim)).astype(np.float32)
    vectors /= np.linalg.norm(vectors, axis=1, keepdims=True)
    ids = rng.choice(10**9, size=n, replace=False).astype(np.int64)
    rows = []
    for i, image_id in enumerate(ids.tolist()):
        row: dict = {"id": image_id, "path": f"{image_id}.jpg",
                     "captions": [f"photo {i % 13} of a {WORDS[i % len(WORDS)]}", WORDS[(i * 7) % len(WORDS)].upper()],
                     "fields": {"colour": ["red", "green", "blue"][i % 3], "year": 2000 + i % 20, "flag": bool(i % 2)}}
        if i % 11:  # some rows have no licence at all
            row["license"] = {"id": int(i % 8), "name": f"licence {i % 8}"}
        rows.append(row)
    return vectors, ids, rows


def make_store(backend: str, tmp_path, request) -> SnapshotStore:
    if backend == "faiss":
        return FaissStore(tmp_path / "snap")
    if backend == MILVUS_SERVER:
        from paraseek.index.milvus_store import MilvusStore

        return MilvusStore(request.getfixturevalue("milvus_standalone").uri, prefix=fresh_prefix())
    return request.getfixturevalue("milvus_store")


def server_cannot_match_inside_captions(backend: str, snap, flt: SearchFilter, queries) -> bool:
    """Milvus 2.3 servers run LIKE only as a prefix match: a caption filter there is refused as the
    request's error naming the field (422 in the service), never an outage. True when it was."""
    if backend != MILVUS_SERVER or flt.caption_contains is None:
        return False
    with pytest.raises(FilterError) as err:
        snap.filtered(flt).search_ids(queries, 10)
    assert err.value.field == "filter.caption_contains"
    return True


def publish(store: SnapshotStore, vectors, ids, rows, spec: IndexSpec, activate: bool = True):
    draft = VersionDraft(store.new_version_name(), vectors, ids, rows, {"kind": "synthetic", "root": "/nonexistent"}, {})
    return store.write_version(draft, REF, spec, queries=vectors[:200], query_source="a sample", activate=activate)


def brute_force(vectors, ids, rows, flt: SearchFilter, queries, k):
    keep = np.ones(len(ids), bool)
    for i, row in enumerate(rows):
        if flt.licence is not None and licence_id(row) not in flt.licence:
            keep[i] = False
        if flt.caption_contains is not None and flt.caption_contains.lower() not in caption_text(row):
            keep[i] = False
        r = flt.id_range
        if r is not None and not ((r.gte is None or ids[i] >= r.gte) and (r.gt is None or ids[i] > r.gt)
                                  and (r.lte is None or ids[i] <= r.lte) and (r.lt is None or ids[i] < r.lt)):
            keep[i] = False
        for name, value in (flt.fields or {}).items():
            stored = row["fields"].get(name)
            if type(stored) is not type(value) or stored != value:
                keep[i] = False
    scores = queries @ vectors[keep].T
    order = np.argsort(-scores, axis=1, kind="stable")[:, :k]
    return ids[keep][order], int(keep.sum())


FILTERS = [
    {"licence": [1, 2]},
    {"licence": [7]},
    {"caption_contains": "beach"},
    {"caption_contains": "50% OFF"},
    {"caption_contains": "snake_case"},
    {"caption_contains": 'a "quoted"'},
    {"caption_contains": "ünïcode"},
    {"id_range": {"gte": 200_000_000, "lt": 600_000_000}},
    {"id_range": {"gt": 900_000_000}},
    {"fields": {"colour": "red"}},
    {"fields": {"year": 2007, "flag": True}},
    {"licence": [0, 3, 5], "caption_contains": "photo 1", "fields": {"colour": "blue"}},
    {"licence": [1], "id_range": {"lte": 1}},  # matches nothing
]


_SERVER_SNAPSHOTS: dict[str, object] = {}


def flat_snapshot(backend: str, tmp_path, request, vectors, ids, rows):
    """The synthetic collection published flat. On the real server (about 11 s a version there) once for
    the module's server; elsewhere fresh for each test."""
    key = f"{backend}:{request.getfixturevalue('milvus_standalone').uri}" if backend == MILVUS_SERVER else None
    if key is not None and key in _SERVER_SNAPSHOTS:
        return _SERVER_SNAPSHOTS[key]
    store = make_store(backend, tmp_path, request)
    publish(store, vectors, ids, rows, IndexSpec(type="flat"))
    snap = store.load(image_space=REF.image_space)
    if key is not None:
        _SERVER_SNAPSHOTS[key] = snap
    return snap


@pytest.mark.parametrize("flt", FILTERS, ids=[str(i) for i in range(len(FILTERS))])
@pytest.mark.quick
def test_filtered_search_is_the_exact_top_k_among_matches(backend, tmp_path, request, flt):
    vectors, ids, rows = synthetic()
    snap = flat_snapshot(backend, tmp_path, request, vectors, ids, rows)
    flt = SearchFilter.model_validate(flt)
    queries = vectors[:5] * 0.5 + vectors[5:10] * 0.5
    if server_cannot_match_inside_captions(backend, snap, flt, queries):
        return
    got_scores, got = snap.filtered(flt).search_ids(queries, 10)
    want, matching = brute_force(vectors, ids, rows, flt, queries, 10)
    for row_got, row_want in zip(got, want):
        assert row_got[row_got >= 0].tolist() == row_want.tolist()
    assert (got >= 0).sum(axis=1).tolist() == [min(10, matching)] * len(queries)
    assert snap.filtered(flt) is snap.filtered(SearchFilter.model_validate(flt.model_dump()))  # equal filters: one view


@pytest.mark.parametrize("kind", ["hnsw", "ivf_flat"])
@pytest.mark.quick
def test_filters_on_approximate_indexes_search_only_matches(backend, tmp_path, request, kind):
    """Few matches: an exact scan of them (FAISS); many: the ANN searched with an id selector, or
    Milvus' own filtered search. Either way every result matches and recall stays high."""
    from paraseek.index import snapshot as faiss_snapshot

    vectors, ids, rows = synthetic(n=4000)
    store = make_store(backend, tmp_path, request)
    publish(store, vectors, ids, rows, IndexSpec(type=kind, nprobe=80, ef_search=256))
    snap = store.load(image_space=REF.image_space)
    queries = vectors[100:120]
    for flt in (SearchFilter(licence=[3]), SearchFilter(fields={"colour": "green"}), SearchFilter(caption_contains="photo")):
        if backend == "faiss":  # push the FAISS path past the small-match scan onto the selector
            request.getfixturevalue("monkeypatch").setattr(faiss_snapshot, "SMALL_MATCH", 100)
            snap._filters.clear()
        if server_cannot_match_inside_captions(backend, snap, flt, queries):
            continue
        _, got = snap.filtered(flt).search_ids(queries, 10)
        want, _ = brute_force(vectors, ids, rows, flt, queries, 10)
        allowed = set(brute_force(vectors, ids, rows, flt, queries[:1], len(ids))[0][0].tolist())
        assert set(got[got >= 0].tolist()) <= allowed
        recall = np.mean([len(set(g) & set(w)) / len(w) for g, w in zip(got.tolist(), want.tolist())])
        assert recall >= 0.9, (flt, recall)


@pytest.mark.quick
def test_a_selective_filter_probes_more_ivf_lists(backend, tmp_path, request, monkeypatch):
    """nprobe is tuned on unfiltered searches: a filter keeping 1 % of the vectors probes nprobe / 0.01
    lists (here all of them). With the tuned nprobe alone Milvus Lite finds 0.06 of the true top 10 and
    FAISS' id-selector search (taken here for 40 matches, as it is past 50,000) less than half; the
    server searched these few matches exactly either way (at 100K its IVF_FLAT found 0.8 of them:
    bench_backends), so there the test checks that the widened search runs and stays exact."""
    from paraseek.index import snapshot as faiss_snapshot
    from paraseek.index.faiss_index import id_selector, search, search_parameters

    monkeypatch.setattr(faiss_snapshot, "SMALL_MATCH", 0)
    vectors, ids, rows = synthetic(n=4000)
    store = make_store(backend, tmp_path, request)
    publish(store, vectors, ids, rows, IndexSpec(type="ivf_flat", nprobe=2))
    snap = store.load(image_space=REF.image_space)
    flt = SearchFilter(id_range={"lt": 10_000_000})  # about 1 % of the random ids
    view = snap.filtered(flt)
    queries = vectors[:40]
    if backend == "faiss":
        spec = snap.manifest.index
        assert spec.nprobe == 2 and view.filtered_spec().nprobe == spec.nlist
        as_tuned = search(snap.index, spec, queries, 10, None, search_parameters(spec, id_selector(snap.ids[view.rows])))[1]
    else:
        nlist = snap.manifest.location["index_params"]["nlist"]
        assert snap.params["nprobe"] == 2 and view.search_params()["nprobe"] == nlist
        as_tuned = snap.search_ids(queries, 10, view.expression)[1]
    want, _ = brute_force(vectors, ids, rows, flt, queries, 10)

    def recall(got):
        return np.mean([len(set(g) & set(w)) / len(w) for g, w in zip(got.tolist(), want.tolist())])

    widened, tuned = recall(view.search_ids(queries, 10)[1]), recall(as_tuned)
    assert widened >= 0.95 and widened >= tuned, (widened, tuned)
    if backend != MILVUS_SERVER:
        assert tuned < 0.5, tuned


@pytest.mark.quick
def test_filter_widening_stays_within_the_index():
    from paraseek.index.milvus_store import widened_for_filter

    assert widened_for_filter({"nprobe": 32}, {"nlist": 4000}, 0.5) == {"nprobe": 64}
    assert widened_for_filter({"nprobe": 32}, {"nlist": 1264}, 0.01) == {"nprobe": 1264}  # every list, no more
    assert widened_for_filter({"nprobe": 32}, {"nlist": 1264}, 1.0) == {"nprobe": 32}
    assert widened_for_filter({"nprobe": 32}, {"nlist": 1264}, 0.0) == {"nprobe": 32}  # nothing matches: nothing to find
    assert widened_for_filter({"ef": 128}, {"M": 32}, 0.5) == {"ef": 256}  # an HNSW beam
    assert widened_for_filter({"ef": 128}, {"M": 32}, 0.01) == {"ef": 1024}  # at most FILTERED_EF_MAX
    assert widened_for_filter({"ef": 2048}, {"M": 32}, 0.1) == {"ef": 2048}  # never narrower than unfiltered
    assert widened_for_filter({"ef": 128}, {"M": 32}, 1.0) == {"ef": 128}
    assert widened_for_filter({}, {}, 0.1) == {}  # FLAT: every vector is compared anyway


@pytest.mark.quick
def test_short_answers_are_asked_again_wider():
    from paraseek.index.milvus_store import params_for_short_answers

    asked, params = [], {"ef": 128}
    while (params := params_for_short_answers(params, "HNSW", {"M": 32})) is not None:
        asked.append(params)
    # a range search, its beam growing to RETRY_EF_MAX, then no more
    assert asked == [{"ef": 512, "radius": -1.0}, {"ef": 2048, "radius": -1.0}, {"ef": 8192, "radius": -1.0},
                     {"ef": 16_384, "radius": -1.0}]
    assert params_for_short_answers({"ef": 1024}, "HNSW", {"M": 32}) == {"ef": 1024, "radius": -1.0}
    assert params_for_short_answers({"nprobe": 8}, "IVF_FLAT", {"nlist": 64}) == {"nprobe": 64}
    assert params_for_short_answers({"nprobe": 64}, "IVF_FLAT", {"nlist": 64}) is None  # every list already
    assert params_for_short_answers({}, "FLAT", {}) is None


@pytest.mark.quick
def test_a_faiss_search_that_answers_short_scans_the_matches(tmp_path, monkeypatch):
    """Past 50,000 matches FAISS searches its ANN index with an id selector; where the lists probed or
    the graph walked hold fewer matches than k (a 1 % filter through a tuned IVF search answers most
    queries short), those queries are answered by the exact scan of the matches instead."""
    from paraseek.index import snapshot as faiss_snapshot

    monkeypatch.setattr(faiss_snapshot, "SMALL_MATCH", 0)
    vectors, ids, rows = synthetic(n=2000)
    store = FaissStore(tmp_path / "snap")
    publish(store, vectors, ids, rows, IndexSpec(type="hnsw", ef_search=64))
    snap = store.load(image_space=REF.image_space)
    flt = SearchFilter(licence=[1])
    queries = vectors[:30]
    want, _ = brute_force(vectors, ids, rows, flt, queries, 10)
    ann_search = faiss_snapshot.search

    def search_cut_off(*args, **kwargs):
        scores, found = ann_search(*args, **kwargs)
        found[::3, 1:], scores[::3, 1:] = -1, -np.inf  # a third of the queries with one hit
        return scores, found

    monkeypatch.setattr(faiss_snapshot, "search", search_cut_off)
    scores, got = snap.filtered(flt).search_ids(queries, 10)
    assert got[::3].tolist() == want[::3].tolist()  # the exact scan's answers
    assert (got >= 0).all() and np.isfinite(scores).all()


@pytest.mark.quick
def test_a_graph_search_that_answers_short_is_asked_again(backend, tmp_path, request, monkeypatch):
    """A Milvus 2.3.5 server's filtered HNSW search sometimes answers a query with 0 or 1 hits of 10
    among a thousand matches (milvus-io/milvus #33933; 30 filtered queries of 1,500 in bench_backends at
    10K, not reproducibly: it depends on the graph). Here the server's answers are cut short as they were
    there: the snapshot asks those queries again, as range searches the server runs with a growing
    beam, and answers in full."""
    if backend == "faiss":
        pytest.skip("FAISS scans the matches of a filter directly")
    vectors, ids, rows = synthetic(n=2000)
    store = make_store(backend, tmp_path, request)
    publish(store, vectors, ids, rows, IndexSpec(type="hnsw", hnsw_m=16, ef_construction=64, ef_search=32))
    snap = store.load(image_space=REF.image_space)
    flt = SearchFilter(licence=[1])  # 1 row in 9
    view = snap.filtered(flt)
    queries = vectors[:30]
    want, _ = brute_force(vectors, ids, rows, flt, queries, 10)

    server_search, asked = store.client.search, []

    def search_as_a_graph_cut_off(collection, data, **kwargs):
        answers = server_search(collection, data=data, **kwargs)
        params = kwargs["search_params"]["params"]
        asked.append((len(data), params))
        if "radius" in params and params["ef"] >= 2048:
            return answers
        # a third of the queries cut to one hit, and the first range search finds no more for half of them
        cut = {row for row in range(len(data)) if row % (3 if "radius" not in params else 2) == 0}
        return [found[:1] if row in cut else found for row, found in enumerate(answers)]

    monkeypatch.setattr(store.client, "search", search_as_a_graph_cut_off)
    _, got = view.search_ids(queries, 10)
    assert (got >= 0).all()
    # only the 10 short queries are asked again, then the 5 still short with a wider beam
    assert asked[1:] == [(10, {"ef": 512, "radius": -1.0}), (5, {"ef": 2048, "radius": -1.0})]
    recall = np.mean([len(set(g) & set(w)) / 10 for g, w in zip(got.tolist(), want.tolist())])
    assert recall >= 0.95, recall


@pytest.mark.quick
def test_a_version_reads_back_whole_with_or_without_its_vectors(backend, tmp_path, request):
    """contents (ids, vectors, rows), iter_metadata (ids, rows: what a checksum build compares) and
    held_ids (ids alone: which files a kept version could not decode) give the same rows."""
    vectors, ids, rows = synthetic()
    snap = flat_snapshot(backend, tmp_path, request, vectors, ids, rows)
    got_ids, got_vectors, got_rows = snap.contents()
    at = {int(i): n for n, i in enumerate(ids.tolist())}
    order = [at[int(i)] for i in got_ids]
    assert sorted(order) == list(range(len(ids))) and np.allclose(got_vectors, vectors[order], atol=1e-6)
    assert [r["id"] for r in got_rows] == got_ids.tolist() and got_rows[0] == snap.metadata_of([got_ids[0]])[int(got_ids[0])]
    parts = list(snap.iter_metadata(chunk=1000))
    assert len(parts) == 3 and all(len(i) == len(r) for i, r in parts)
    assert np.concatenate([i for i, _ in parts]).tolist() == got_ids.tolist()
    assert [row for _, r in parts for row in r] == got_rows
    assert sorted(snap.held_ids().tolist()) == sorted(ids.tolist())


@pytest.mark.quick
def test_malformed_filters_name_the_part(backend, tmp_path, request):
    vectors, ids, rows = synthetic(n=200)
    store = make_store(backend, tmp_path, request)
    publish(store, vectors, ids, rows, IndexSpec(type="flat"))
    snap = store.load()
    with pytest.raises(FilterError) as err:
        snap.filtered(SearchFilter(fields={"color": "red"}))  # a misspelt user field
    assert err.value.field == "filter.fields.color" and "colour" in str(err.value)
    assert sorted(snap.user_fields) == ["colour", "flag", "year"]
    for bad in ({}, {"licence": []}, {"licence": ["1"]}, {"caption_contains": " "}, {"id_range": {}},
                {"id_range": {"gt": 1, "gte": 2}}, {"fields": {"bad name": 1}}, {"fields": {"x": [1]}},
                {"fields": {"x": float("nan")}}, {"licence": [2**63]}, {"unknown": 1}):
        with pytest.raises(ValidationError):
            SearchFilter.model_validate(bad)


@pytest.mark.quick
def test_publication_is_atomic_and_a_failed_build_leaves_nothing(backend, tmp_path, request, monkeypatch):
    vectors, ids, rows = synthetic(n=5000)
    store = make_store(backend, tmp_path, request)
    _, first = publish(store, vectors[:100], ids[:100], rows[:100], IndexSpec(type="flat"))
    before = store.current_version()
    assert before == first.version and store.versions() == [before]

    # a version written without activation is published but not current
    _, second = publish(store, vectors[:200], ids[:200], rows[:200], IndexSpec(type="flat"), activate=False)
    assert store.current_version() == before and store.versions() == [before, second.version]
    store.activate(second.version)
    assert store.current_version() == second.version and len(store.load()) == 200
    store.activate(before)

    # a build that fails midway (after some rows went in) leaves no trace and never becomes current
    if backend != "faiss":
        from paraseek.index import milvus_store

        original = milvus_store.MilvusStore._insert

        def fail_midway(self, name, ids_, vectors_, metadata, on_rows=None):
            original(self, name, ids_[:2000], vectors_[:2000], metadata[:2000])
            raise RuntimeError("the database went away mid-build")

        monkeypatch.setattr(milvus_store.MilvusStore, "_insert", fail_midway)
        names_before = set(store.client.list_collections())
    else:
        from paraseek.index import snapshot as faiss_snapshot

        def fail_midway(*args, **kwargs):
            raise RuntimeError("the disk filled up mid-build")

        monkeypatch.setattr(faiss_snapshot, "write_snapshot_files", fail_midway)
    with pytest.raises(RuntimeError, match="mid-build"):
        publish(store, vectors, ids, rows, IndexSpec(type="flat"))
    assert store.current_version() == before and store.versions() == [before, second.version]
    if backend != "faiss":
        assert set(store.client.list_collections()) == names_before
    else:
        assert not list((tmp_path / "snap" / "versions").glob(".tmp-*"))
    snap = store.load()
    assert snap.version == before and len(snap) == 100
    assert snap.search_ids(vectors[:1], 1)[1][0, 0] == ids[0]


class Stopped(Exception):
    """What a cancelled job's progress callback raises."""


@pytest.mark.quick
def test_a_write_reports_the_rows_indexed_and_stops_where_its_callback_raises(backend, tmp_path, request, monkeypatch):
    """``on_progress`` sees each chunk added (FAISS) or inserted (Milvus), then the whole count before the
    recall is measured and before the version is published; an exception it raises (a cancel) fails the
    write there and leaves nothing: no version, no staging folder or collection, current untouched."""
    from paraseek.index import milvus_store, recall

    monkeypatch.setattr(recall, "add_chunk_rows", lambda spec: 1000)
    monkeypatch.setattr(milvus_store, "INSERT_ROWS", 1000)
    store = make_store(backend, tmp_path, request)
    vectors, ids, rows = synthetic(n=3000)
    _, first = publish(store, vectors[:100], ids[:100], rows[:100], IndexSpec(type="flat"))
    seen: list[tuple[int, int]] = []
    draft = VersionDraft(store.new_version_name(), vectors, ids, rows, {"kind": "synthetic"}, {})
    _, second = store.write_version(draft, REF, IndexSpec(type="ivf_flat", nlist=8), queries=vectors[:50],
                                    query_source="a sample", on_progress=lambda done, total: seen.append((done, total)))
    assert seen[:3] == [(1000, 3000), (2000, 3000), (3000, 3000)] and set(seen[3:]) == {(3000, 3000)} and len(seen) >= 5
    store.activate(first.version)
    collections = set(store.client.list_collections()) if backend != "faiss" else set()

    def stop_at(where):
        def on_progress(done, total):
            if (done, total) == where:
                raise Stopped(f"stopped at {where}")
        return on_progress

    for where in [(2000, 3000), (3000, 3000)]:  # midway through the rows; once all are in
        draft = VersionDraft(store.new_version_name(), vectors, ids, rows, {"kind": "synthetic"}, {})
        with pytest.raises(Stopped):
            store.write_version(draft, REF, IndexSpec(type="flat"), queries=vectors[:50], query_source="a sample",
                                on_progress=stop_at(where))
        assert store.current_version() == first.version and store.versions() == [first.version, second.version]
        if backend == "faiss":
            assert not list((tmp_path / "snap" / "versions").glob(".tmp-*"))
        else:
            assert set(store.client.list_collections()) == collections


KILLED_BUILD = textwrap.dedent("""
    import sys, numpy as np
    sys.path.insert(0, {root!r})
    from paraseek.index.milvus_store import MilvusStore
    from paraseek.index.faiss_index import IndexSpec
    from paraseek.index.versions import BundleRef, VersionDraft
    from paraseek.index import milvus_store
    store = MilvusStore({uri!r}, prefix={prefix!r})
    original = milvus_store.MilvusStore._insert
    def slow(self, name, ids, vectors, metadata, on_rows=None):
        print("inserting", flush=True)
        original(self, name, ids[:1000], vectors[:1000], metadata[:1000])
        print("inserted", flush=True)
        import time; time.sleep(600)
    milvus_store.MilvusStore._insert = slow
    rng = np.random.default_rng(1)
    v = rng.standard_normal((5000, 32)).astype(np.float32); v /= np.linalg.norm(v, axis=1, keepdims=True)
    ids = np.arange(5000, dtype=np.int64)
    draft = VersionDraft(store.new_version_name(), v, ids, [{{"id": int(i)}} for i in ids], {{}}, {{}})
    store.write_version(draft, BundleRef(name="b", version="1", image_space="test/space"), IndexSpec(type="flat"),
                        queries=v[:10], query_source="x")
""")


def test_a_build_killed_midway_never_becomes_current(milvus_server, tmp_path):
    """kill -9 of a process building into Milvus (a server: another process can look meanwhile): the
    alias still names the old version, and the next store to open removes the half-built collection."""
    from paraseek.index.milvus_store import MilvusStore

    store = MilvusStore(milvus_server["uri"], prefix="killed")
    vectors, ids, rows = synthetic(n=300)
    _, first = publish(store, vectors, ids, rows, IndexSpec(type="flat"))
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    script = KILLED_BUILD.format(root=root, uri=milvus_server["uri"], prefix="killed")
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        assert proc.stdout is not None
        deadline = time.time() + 120
        while time.time() < deadline and proc.stdout.readline().strip() != "inserted":
            assert proc.poll() is None, proc.stdout.read()
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    finally:
        if proc.poll() is None:
            proc.kill()
    half_built = [n for n in store.client.list_collections() if n.startswith("killed_v0002")]
    assert half_built, "the build never created its collection"
    assert store.current_version() == first.version and store.versions() == [first.version]
    assert len(store.load()) == 300

    removed = MilvusStore(milvus_server["uri"], prefix="killed").clean_stale()
    assert removed and not [n for n in store.client.list_collections() if n.startswith("killed_v0002")]
    assert store.current_version() == first.version


def test_update_and_copy_between_backends(backend, tmp_path, request, starter_encoder, shared_data):
    """Add and remove images on either backend, then copy the result to the other backend: same
    vectors, same metadata, same answers."""
    from paraseek.index.builder import build_snapshot

    store = make_store(backend, tmp_path, request)
    build_snapshot(shared_data / "coco-mini/captions_val2017.json", starter_encoder, store, progress=False)
    base = store.load(image_space=starter_encoder.image_space)
    some = [int(i) for i in list(base.metadata_of(base.search_ids(starter_encoder.encode_text(["a dog"]), 3)[1][0]))]
    removed = update_snapshot(store, starter_encoder, remove=some[:2], progress=False)
    after = store.load(image_space=starter_encoder.image_space)
    assert after.version == removed.manifest.version and after.manifest.parent == base.version
    assert len(after) == len(base) - 2 and not after.metadata_of(some[:2]) and after.metadata_of(some[2:])
    with pytest.raises(SnapshotError, match="not in snapshot"):
        update_snapshot(store, starter_encoder, remove=[123], progress=False)

    other = request.getfixturevalue("milvus_store") if backend == "faiss" else FaissStore(tmp_path / "copy")
    copied = copy_snapshot(after, other)
    twin = other.load(image_space=starter_encoder.image_space)
    assert copied.manifest.backend == other.backend and len(twin) == len(after)
    queries = starter_encoder.encode_text(["a dog on a beach", "a plate of food", "a train"])
    assert np.array_equal(twin.search_ids(queries, 10)[1], after.search_ids(queries, 10)[1])
    ids = [int(i) for i in after.search_ids(queries, 5)[1].ravel()]
    assert twin.metadata_of(ids) == after.metadata_of(ids)
    assert np.allclose(twin.vectors_of(ids), after.vectors_of(ids))
    # a caption filter where the server runs one (2.3 servers: prefix matches only)
    flt = SearchFilter(caption_contains="a" if backend != MILVUS_SERVER else None, licence=[1, 2, 3, 4, 5, 6])
    assert np.array_equal(twin.filtered(flt).search_ids(queries, 10)[1], after.filtered(flt).search_ids(queries, 10)[1])


@pytest.mark.quick
def test_precomputed_vectors_build_into_either_backend(backend, tmp_path, request):
    """Shards of vectors computed elsewhere (with user columns) index into the store, are refused to a
    bundle of another image space, and filter on their user fields."""
    from paraseek.index.builder import build_snapshot_from_vectors
    from tests.index.test_vector_sources import write_shards

    vectors = write_shards(tmp_path / "emb")
    store = make_store(backend, tmp_path, request)
    result = build_snapshot_from_vectors(tmp_path / "emb", store, image_space="test/space", progress=False)
    assert result.manifest.backend == store.backend and result.manifest.count == len(vectors) == 100
    snap = store.load(image_space="test/space")
    with pytest.raises(SnapshotError, match="image space"):
        store.load(image_space="another/space")
    _, ids = snap.search_ids(vectors[:3], 1)
    assert ids[:, 0].tolist() == [1000, 1001, 1002]  # each vector finds itself (ids from the metadata)
    assert snap.user_fields == ["camera"]  # the extra metadata column
    _, got = snap.filtered(SearchFilter(fields={"camera": "cam1"})).search_ids(vectors[:5], 100)
    for row in got:
        found = row[row >= 0].tolist()
        assert sorted(found) == [i for i in range(1000, 1100) if i % 3 == 1]  # every match, nothing else


@pytest.mark.quick
def test_index_types_map_to_milvus_or_say_they_cannot():
    from paraseek.core.errors import UserError
    from paraseek.index.milvus_store import native_index

    assert native_index(IndexSpec(type="ivf_flat", nlist=8, nprobe=4)) == ("IVF_FLAT", {"nlist": 8}, {"nprobe": 4})
    with pytest.raises(UserError, match="'ivf_fp16' has no Milvus counterpart"):
        native_index(IndexSpec(type="ivf_fp16", nlist=8))


@pytest.mark.quick
def test_a_bare_grpc_error_from_pymilvus_is_an_outage(milvus_store, monkeypatch):
    """pymilvus lets a gRPC deadline through unwrapped while a server restarts: the search is then
    unavailable (503), not a crash (500); the one retry for a dropped connection runs too."""
    import grpc

    from paraseek.index.store import IndexUnavailable

    class DeadlineExceeded(grpc.RpcError):
        def __str__(self) -> str:
            return "<_InactiveRpcError of RPC that terminated with: status = StatusCode.UNAVAILABLE>"

    vectors, ids, rows = synthetic(n=300)
    publish(milvus_store, vectors, ids, rows, IndexSpec(type="flat"))
    snap = milvus_store.load()
    calls = []

    def failing(*args, **kwargs):
        calls.append(args)
        raise DeadlineExceeded()

    monkeypatch.setattr(milvus_store.client, "search", failing)
    with pytest.raises(IndexUnavailable, match="search failed"):
        snap.search_ids(vectors[:1], 5)
    assert len(calls) == 2  # tried again once, as a dropped connection is
    # the version calls of a store opened before the outage (a server's rollback, its poll) are outages too
    monkeypatch.setattr(milvus_store.client, "query", failing)
    monkeypatch.setattr(milvus_store.client, "list_aliases", failing)
    for call, name in ((milvus_store.versions, "versions"), (milvus_store.current_version, "current version"),
                       (milvus_store.previous_version, "versions"), (lambda: milvus_store.activate(snap.version), "manifest"),
                       (lambda: milvus_store.prune(2), "versions")):
        with pytest.raises(IndexUnavailable, match=f"{name} failed: <_InactiveRpcError"):
            call()


@pytest.mark.quick
def test_what_a_published_version_leaves_is_read_strong_only_where_a_bounded_read_lags(milvus_store, monkeypatch):
    """A Milvus server's default read (Bounded) may miss a write of the last seconds; a Strong one waits for
    the server's time tick (200-400 ms a query on a 2.3.5 standalone). What a published version leaves (its
    manifest row, its vectors) only appears, so the store reads it Bounded and again Strong only where that
    read lacks it: a long-published version costs no Strong read (a service start, each snapshot poll), and
    one published a moment ago is still found. Milvus Lite reads everything at once, so a lag is made here."""
    vectors, ids, rows = synthetic(n=300)
    _, first = publish(milvus_store, vectors, ids, rows, IndexSpec(type="flat"))
    real, levels, lagging = milvus_store.client.query, [], [False]

    def query(collection, filter="", output_fields=None, **kwargs):
        levels.append(kwargs.get("consistency_level"))
        found = real(collection, filter=filter, output_fields=output_fields, **kwargs)
        if lagging[0] and kwargs.get("consistency_level") != "Strong":  # nothing of the version written yet
            return [{"count(*)": 0}] if output_fields == ["count(*)"] else []
        return found

    monkeypatch.setattr(milvus_store.client, "query", query)
    for lag in (False, True):
        lagging[0] = lag
        levels.clear()
        assert milvus_store.current_version() == first.version
        assert milvus_store.manifest().version == first.version
        assert len(milvus_store.load(image_space=REF.image_space)) == 300
        assert ("Strong" in levels) == lag, levels
    # what can change under a reader is still read Strong: the list of versions, a build's state
    levels.clear()
    assert milvus_store.versions() == [first.version] and levels == ["Strong"]


@pytest.mark.quick
def test_searches_and_lookups_from_many_threads_agree_with_one(backend, tmp_path, request, monkeypatch):
    """The service searches from worker threads (in parallel when batching is off): a filtered view's
    first searches, metadata lookups through Milvus' small LRU and the memory-mapped vectors, all at
    once, answer exactly what one thread does."""
    from concurrent.futures import ThreadPoolExecutor

    from paraseek.index import milvus_store
    from paraseek.index import snapshot as faiss_snapshot

    monkeypatch.setattr(faiss_snapshot, "SMALL_MATCH", 100)  # FAISS: the id-selector path, built on first use
    monkeypatch.setattr(milvus_store, "METADATA_CACHE", 64)  # Milvus: an LRU evicting all the time
    vectors, ids, rows = synthetic(n=3000)
    store = make_store(backend, tmp_path, request)
    publish(store, vectors, ids, rows, IndexSpec(type="hnsw", ef_search=128))
    by_id = {r["id"]: r for r in rows}
    rng = np.random.default_rng(1)
    batches = [rng.choice(ids, size=40, replace=False) for _ in range(64)]
    flt = SearchFilter(fields={"colour": "green"})
    queries = vectors[:8]
    want = store.load(image_space=REF.image_space).filtered(flt).search_ids(queries, 10)[1]

    snap = store.load(image_space=REF.image_space)  # fresh: nothing built yet
    def work(batch):
        got = snap.metadata_of(batch)
        assert got == {int(i): by_id[int(i)] for i in batch}
        assert np.array_equal(snap.vectors_of(batch[:5]), vectors[[int(np.flatnonzero(ids == i)[0]) for i in batch[:5]]])
        return snap.filtered(flt).search_ids(queries, 10)[1]

    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(work, batches))
    for got in results:
        assert np.array_equal(got, want)
    if backend == "faiss":
        assert snap.vectors() is snap.vectors()  # mapped once, not reopened per search
        view = snap.filtered(flt)
        first, second = view.search_params(), view.search_params()
        assert first is not second and int(first.sel.this) == int(second.sel.this)  # one selector, parameters per call


def _two_writers(tmp_path, out_args: list[str]) -> list[subprocess.CompletedProcess]:
    """Two `paraseek index build --embeddings` processes into one collection, started together."""
    procs = []
    for writer in range(2):
        folder = tmp_path / f"emb{writer}"
        folder.mkdir()
        vectors, ids, _ = synthetic(n=6000, seed=writer)
        np.save(folder / "v.npy", vectors)
        (folder / "v.jsonl").write_text("".join(f'{{"id": {int(i)}, "caption": "writer {writer}"}}\n' for i in ids))
        procs.append([sys.executable, "-m", "paraseek.cli", "index", "build", "--embeddings", str(folder / "v.npy"),
                      "--image-space", REF.image_space, "--type", "hnsw", *out_args])
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    running = [subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env) for cmd in procs]
    return [subprocess.CompletedProcess(p.args, p.wait(300), p.stdout.read() if p.stdout else "") for p in running]


def _check_two_versions(store: SnapshotStore, versions: list[str]) -> None:
    assert len(set(versions)) == 2, versions  # two distinct names
    writers = set()
    for version in versions:
        snap = store.load(version)  # complete: FAISS verifies every checksum, Milvus counts the rows
        assert len(snap) == 6000
        writers.add(next(iter(snap.metadata_of([int(snap.search_ids(np.ones((1, 32), np.float32) / 32**0.5, 1)[1][0, 0])]).values()))["captions"][0])
        snap.close()
    assert writers == {"writer 0", "writer 1"}  # each version holds its own writer's rows, none overwritten
    assert store.current_version() in versions and len(store.load()) == 6000


def test_two_processes_building_into_one_faiss_root(tmp_path):
    """Each takes its own version name and staging folder under the root's writer lock; neither removes
    the other's folder; both publish complete versions and `current` names one of them."""
    done = _two_writers(tmp_path, ["--out", str(tmp_path / "snap")])
    assert all(p.returncode == 0 for p in done), [p.stdout[-2000:] for p in done]
    store = FaissStore(tmp_path / "snap")
    _check_two_versions(store, store.versions())
    assert not list((tmp_path / "snap" / "versions").glob(".tmp-*"))  # nothing staged left behind


def test_two_processes_building_into_one_milvus_collection(milvus_server, tmp_path):
    from paraseek.index.milvus_store import MilvusStore

    done = _two_writers(tmp_path, ["--backend", "milvus", "--uri", milvus_server["uri"], "--collection", "race"])
    assert all(p.returncode == 0 for p in done), [p.stdout[-2000:] for p in done]
    store = MilvusStore(milvus_server["uri"], prefix="race")
    _check_two_versions(store, store.versions())


@pytest.mark.quick
def test_an_alias_created_by_another_writer_after_the_check_is_moved_not_an_error(milvus_store, monkeypatch):
    """What two first builds into one collection race on: both see no alias; the later create fails."""
    from paraseek.index.milvus_store import MilvusStore

    vectors, ids, rows = synthetic(n=200)
    _, first = publish(milvus_store, vectors[:100], ids[:100], rows[:100], IndexSpec(type="flat"))
    _, second = publish(milvus_store, vectors, ids, rows, IndexSpec(type="flat"), activate=False)
    stale = [False]  # the alias is already there, but this writer looked before it was
    real = MilvusStore._alias_exists
    monkeypatch.setattr(MilvusStore, "_alias_exists", lambda self: stale.pop() if stale else real(self))
    milvus_store.activate(second.version)
    assert milvus_store.current_version() == second.version and len(milvus_store.load()) == 200


@pytest.mark.quick
def test_clean_stale_keeps_the_collection_of_a_build_that_begins_while_it_runs(milvus_store, monkeypatch):
    from paraseek.index.milvus_store import MilvusStore

    other = MilvusStore(milvus_store.uri, prefix=milvus_store.prefix)  # a second writer of the collection
    began: list[str] = []
    real = MilvusStore._rows

    def rows_then_a_build_begins(self, state=None):
        rows = real(self, state)
        if self is milvus_store and state is None and not began:  # after the cleaner read what builds exist
            began.append(other.begin_version())
            other._create(other.collection(began[0]), 32)
        return rows

    monkeypatch.setattr(MilvusStore, "_rows", rows_then_a_build_begins)
    assert milvus_store.clean_stale() == [] and began
    assert other.client.has_collection(other.collection(began[0]))


@pytest.mark.quick
def test_dropping_a_collection_another_writer_dropped_first_is_not_an_error(milvus_store, monkeypatch):
    from pymilvus import MilvusException

    version = milvus_store.begin_version()
    name = milvus_store.collection(version)
    milvus_store._create(name, 32)
    real = milvus_store.client.drop_collection

    def dropped_meanwhile(collection_name, **kwargs):
        real(collection_name)  # the other writer's drop, between this one's check and its drop
        raise MilvusException(code=100, message=f"collection not found[collection={collection_name}]")

    monkeypatch.setattr(milvus_store.client, "drop_collection", dropped_meanwhile)
    milvus_store.abort_version(version)
    assert not milvus_store.client.has_collection(name) and version not in [r["version"] for r in milvus_store._rows()]
    milvus_store._create(name, 32)

    def refused(collection_name, **kwargs):
        raise MilvusException(code=1, message="the server refused")

    monkeypatch.setattr(milvus_store.client, "drop_collection", refused)
    with pytest.raises(MilvusException):
        milvus_store._drop_collection(name)  # still there: the failure is this writer's, not a race


@pytest.mark.quick
def test_a_staging_folder_is_never_taken_over(tmp_path):
    from paraseek.index.snapshot import begin_version, clean_stale_staging, staging_dir

    root = tmp_path / "snap"
    first, stage = begin_version(root)
    second, _ = begin_version(root)
    assert first != second and first[:5] != second[:5]  # the staged name counts as taken
    with pytest.raises(FileExistsError):
        staging_dir(root, first)
    assert clean_stale_staging(root) == [] and stage.is_dir()  # its owner (this process) is alive


@pytest.mark.parametrize("stopped", [True, False])
def test_a_milvus_lite_folder_removed_after_stop_lite_stays_removed(tmp_path, stopped):
    """Milvus Lite's in-process server writes its collections back when the process exits: a temporary
    folder removed before that comes back, unless ``stop_lite`` stopped the server first."""
    folder = tmp_path / "lite"
    script = textwrap.dedent(f"""
        import shutil
        import numpy as np
        from paraseek.index.faiss_index import IndexSpec
        from paraseek.index.milvus_store import MilvusStore, stop_lite
        from paraseek.index.versions import BundleRef, VersionDraft

        uri = {str(folder / "m.db")!r}
        store = MilvusStore(uri, prefix="t")
        vectors = np.eye(8, dtype=np.float32)
        draft = VersionDraft(store.begin_version(), vectors, np.arange(8), [{{"id": i}} for i in range(8)], {{}}, {{}})
        store.write_version(draft, BundleRef(name="b", version="1", image_space="s"), IndexSpec(type="flat"),
                            queries=vectors[:2], query_source="a sample")
        store.close()
        if {stopped}:
            stop_lite(uri)
        shutil.rmtree({str(folder)!r})
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert folder.exists() is not stopped  # written back at exit by a server left running
