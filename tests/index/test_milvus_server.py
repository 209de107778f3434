"""The Milvus backend against a real Milvus 2.3.5 standalone server (not Milvus Lite): one server for
this module. A server answers reads at bounded staleness unless asked for more, and refuses LIKE
patterns other than prefixes; Milvus Lite does neither, so only a real server shows both."""

from __future__ import annotations

import numpy as np
import pytest
from fastapi.testclient import TestClient
from typer.testing import CliRunner

from paraseek.index.builder import copy_snapshot
from paraseek.index.faiss_index import IndexSpec
from paraseek.index.filters import FilterError, SearchFilter
from paraseek.index.milvus_store import MilvusStore
from paraseek.index.store import IndexUnavailable
from paraseek.index.snapshot import Snapshot
from paraseek.index.versions import SnapshotError
from paraseek.cli import app
from tests.conftest import COCO_VAL_JSON
from tests.index.test_backends import REF, brute_force, publish, synthetic


@pytest.fixture(scope="module")
def milvus_standalone(own_milvus_standalone):
    """This module stops and restarts the server: one of its own, not the run's shared one."""
    return own_milvus_standalone


@pytest.fixture(scope="module")
def demo_snapshot(starter_encoder, tmp_path_factory):
    from paraseek.index.demo import build_demo_snapshot

    root = tmp_path_factory.mktemp("demo-snap")
    build_demo_snapshot(starter_encoder, root, progress=False)
    return root


def test_cli_build_into_a_real_server_publishes_and_searches(milvus_standalone, starter_bundle, shared_data):
    """The reported failure: 'no published version' right after embedding, from reads at bounded staleness."""
    uri = milvus_standalone.uri
    built = CliRunner().invoke(app, ["index", "build", str(COCO_VAL_JSON), "--bundle", str(starter_bundle),
                                     "--backend", "milvus", "--uri", uri, "--collection", "val"])
    assert built.exit_code == 0, built.output
    assert "published v0001-" in built.output and "159 images" in built.output
    found = CliRunner().invoke(app, ["index", "search", "a red bus", "--backend", "milvus", "--uri", uri, "--collection", "val",
                                     "--bundle", str(starter_bundle), "-k", "5", "--json"])
    assert found.exit_code == 0, found.output
    assert "bus" in found.output.lower()
    # a rebuild (another index type) reads the server's vectors of the unchanged photos back instead of encoding them
    build = ["index", "build", str(COCO_VAL_JSON), "--bundle", str(starter_bundle), "--backend", "milvus", "--uri", uri,
             "--collection", "val", "--type", "hnsw"]
    again = CliRunner().invoke(app, build)
    assert again.exit_code == 0, again.output
    assert "159 vectors reused from v0001-" in again.output and "0 images encoded" in again.output
    # the same build once more: nothing changed, no third collection
    same = CliRunner().invoke(app, build)
    assert same.exit_code == 0 and "nothing changed since v0002-" in same.output, same.output
    assert len(MilvusStore(uri, prefix="val").versions()) == 2


def test_search_and_filters_match_faiss_exactly(milvus_standalone, demo_snapshot, starter_encoder):
    faiss_snap = Snapshot.load(demo_snapshot)
    store = MilvusStore(milvus_standalone.uri, prefix="demo")
    copy_snapshot(faiss_snap, store)
    snap = store.load(image_space=faiss_snap.manifest.image_space)
    assert len(snap) == len(faiss_snap) == 76
    queries = starter_encoder.encode_text(["a dog on a beach", "a plate of food", "a red bus in the street"])
    _, want = faiss_snap.search_ids(queries, 5)
    _, got = snap.search_ids(queries, 5)
    assert got.tolist() == want.tolist()
    for flt in (SearchFilter(licence=[5]), SearchFilter(id_range={"gte": 200000, "lt": 500000})):
        _, want = faiss_snap.filtered(flt).search_ids(queries, 5)
        _, got = snap.filtered(flt).search_ids(queries, 5)
        assert got.tolist() == want.tolist(), flt
    # Milvus 2.3 matches LIKE only at the start of a text: the request's fault, named, not an outage
    with pytest.raises(FilterError, match="needs Milvus 2.4") as refused:
        snap.filtered(SearchFilter(caption_contains="dog")).search_ids(queries, 5)
    assert refused.value.field == "filter.caption_contains"


def test_a_new_version_moves_the_alias_and_the_old_one_stays_loadable(milvus_standalone):
    store = MilvusStore(milvus_standalone.uri, prefix="alias")
    replica = MilvusStore(milvus_standalone.uri, prefix="alias")  # another client, as a replica's poll is
    vectors, ids, rows = synthetic(n=500)
    _, first = publish(store, vectors, ids, rows, IndexSpec(type="flat"))
    _, second = publish(store, vectors[:300], ids[:300], rows[:300], IndexSpec(type="hnsw"))
    # read at once, within the server's bounded staleness: the store reads again Strong what a lagging read lacks
    assert replica.current_version() == second.version and replica.manifest().version == second.version
    assert len(replica.load(image_space=REF.image_space)) == 300
    assert store.current_version() == second.version and store.versions() == [first.version, second.version]
    assert len(store.load(image_space=REF.image_space)) == 300
    assert len(store.load(first.version, image_space=REF.image_space)) == 500
    flt = SearchFilter(fields={"colour": "red"})
    _, got = store.load(image_space=REF.image_space).filtered(flt).search_ids(vectors[:3], 5)
    want, _ = brute_force(vectors[:300], ids[:300], rows[:300], flt, vectors[:3], 5)
    assert np.mean([len(set(g) & set(w)) / 5 for g, w in zip(got.tolist(), want.tolist())]) >= 0.9


def test_a_version_is_published_once_indexed_and_an_index_the_server_cannot_build_fails_the_build(milvus_standalone):
    """A server indexes flushed segments in the background: a build publishes only once every vector is
    indexed, and its first search goes through that index (a collection loaded before its rows were
    indexed is searched through the server's interim IVF index, where HNSW's ef changes nothing and
    a 1 % filter found 0.66 of its top 10). This server build has no disk-index support
    (DISKANN fails with bad_function_call and its index node retries for ever): such a build fails
    after the index timeout, drops what it wrote, and the alias stays."""
    store = MilvusStore(milvus_standalone.uri, prefix="indexed")
    vectors, ids, rows = synthetic(n=3000)
    _, first = publish(store, vectors, ids, rows, IndexSpec(type="hnsw"))
    index = store.client.describe_index(store.collection(first.version), "vector")
    assert index["index_type"] == "HNSW" and index["indexed_rows"] == 3000 and index["pending_index_rows"] == 0
    snap = store.load()
    with pytest.raises(IndexUnavailable, match=r"ef\(5\) should be larger than k\(10\)"):  # HNSW reads ef at once
        snap.search_ids(vectors[:1], 10, params={"ef": 5})
    assert snap.search_ids(vectors[:1], 10, params={"ef": 64})[1][0][0] == ids[0]

    disk = MilvusStore(milvus_standalone.uri, prefix="indexed", index_type="DISKANN", search_params={"search_list": 64},
                       index_timeout_s=10)
    with pytest.raises(SnapshotError, match=r"indexed 0 of 3000 vectors .* as DISKANN in 10 s"):
        publish(disk, vectors, ids, rows, IndexSpec(type="flat"))
    assert store.current_version() == first.version and store.versions() == [first.version]
    assert [n for n in store.client.list_collections() if n.startswith("indexed_v")] == [store.collection(first.version)]


def test_the_service_serves_from_a_real_server(milvus_standalone, starter_bundle, demo_snapshot, tmp_path):
    from paraseek.core.settings import Settings
    from paraseek.service.main import create_app

    store = MilvusStore(milvus_standalone.uri, prefix="served")
    copy_snapshot(Snapshot.load(demo_snapshot), store)
    settings = Settings(bundle=starter_bundle, snapshot=demo_snapshot, home=tmp_path, log_json=False, index_backend="milvus",
                        milvus_uri=milvus_standalone.uri, milvus_collection="served")
    with TestClient(create_app(settings)) as c:
        r = c.post("/v1/search", json={"query": "a dog on a beach", "k": 5, "filter": {"licence": [4, 5]}})
        assert r.status_code == 200, r.text
        assert len(r.json()["results"]) == 5 and r.json()["snapshot_version"] == store.current_version()
        refused = c.post("/v1/search", json={"query": "a dog", "k": 5, "filter": {"caption_contains": "dog"}})
        assert refused.status_code == 422 and refused.json()["detail"][0]["loc"] == ["body", "filter", "caption_contains"]


def test_two_replicas_follow_one_engine_through_a_reindex_and_a_server_restart(milvus_standalone, starter_bundle,
                                                                                demo_snapshot, shared_data, tmp_path):
    """Two `paraseek serve` processes on one real server, both under load: a reindex on A publishes and
    moves the alias, B follows within its poll interval, and no query fails on either. Then the Milvus
    server restarts under that load: while it is away requests get 503 with Retry-After and no other
    error, and both replicas answer again by themselves, from the same version."""
    import itertools
    import signal
    import threading
    import time

    import httpx

    from paraseek.loadtests.server import start_server

    copy_snapshot(Snapshot.load(demo_snapshot), MilvusStore(milvus_standalone.uri, prefix="replicas"))
    env = {"PARASEEK_BUNDLE": str(starter_bundle), "PARASEEK_INDEX_BACKEND": "milvus", "PARASEEK_MILVUS_URI": milvus_standalone.uri,
           "PARASEEK_MILVUS_COLLECTION": "replicas", "PARASEEK_SNAPSHOT_POLL_S": "1", "PARASEEK_ADMIN_TOKEN": "t",
           "PARASEEK_REINDEX_ROOT": str(shared_data), "PARASEEK_LOG_JSON": "false", "PARASEEK_MILVUS_TIMEOUT_S": "3",
           "NLTK_DATA": str(shared_data / "nltk_data")}
    servers = [start_server({**env, "PARASEEK_HOME": str(tmp_path / name)}, log=tmp_path / f"{name}.log") for name in ("a", "b")]
    answers: dict[str, list[tuple[int, str | None]]] = {url: [] for _, url in servers}  # (status, Retry-After) per replica
    stop = threading.Event()

    def load(url: str) -> None:
        with httpx.Client(timeout=60) as client:
            for n in itertools.count():
                if stop.is_set():
                    return
                # a query of its own each time: an answer from the response cache would hide an outage
                r = client.post(f"{url}/v1/search", json={"query": f"a dog on a beach {n}", "k": 5, "expansion": {"method": "none"}})
                answers[url].append((r.status_code, r.headers.get("retry-after")))
                time.sleep(0.05)

    def version(url: str) -> str:
        return httpx.get(f"{url}/v1/info", timeout=10).json()["snapshot"]["version"]

    def answered_since(mark: dict[str, int]) -> dict[str, list[tuple[int, str | None]]]:
        return {url: got[mark[url]:] for url, got in answers.items()}

    loaders = [threading.Thread(target=load, args=(url,)) for _, url in servers]
    for loader in loaders:
        loader.start()
    try:
        (_, a), (_, b) = servers
        before = version(b)
        job = httpx.post(f"{a}/v1/admin/reindex", headers={"Authorization": "Bearer t"}, timeout=30,
                         json={"source": str(shared_data / "coco-mini/captions_val2017.json")}).json()
        deadline = time.monotonic() + 180
        state = job
        while state["state"] not in ("succeeded", "failed") and time.monotonic() < deadline:
            time.sleep(0.5)
            state = httpx.get(f"{a}/v1/admin/jobs/{job['id']}", headers={"Authorization": "Bearer t"}).json()
        assert state["state"] == "succeeded", state
        published = time.monotonic()
        while version(b) == before and time.monotonic() < published + 10:
            time.sleep(0.2)
        assert version(a) == version(b) == state["snapshot_version"]  # B followed within its poll interval
        for url, got in answers.items():  # no query failed
            assert len(got) > 10 and {status for status, _ in got} == {200}, (url, sorted(set(got)))

        mark = {url: len(got) for url, got in answers.items()}
        milvus_standalone.stop()  # SIGTERM: a restart, as an orchestrator does it
        time.sleep(3)
        milvus_standalone.start()
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline and not all(len(got) >= 3 and {s for s, _ in got[-3:]} == {200}
                                                      for got in answered_since(mark).values()):
            time.sleep(0.5)
        during = answered_since(mark)
        for url, got in during.items():
            assert {s for s, _ in got} <= {200, 503}, (url, sorted({s for s, _ in got}))  # no other error
            assert 503 in {s for s, _ in got}, url  # the outage was seen, not answered from a cache
            assert all(retry for s, retry in got if s == 503), url  # every 503 says when to come back
            assert {s for s, _ in got[-3:]} == {200}, (url, got[-10:])  # and each replica recovered by itself
        assert version(a) == version(b) == state["snapshot_version"]  # the alias survived the restart
    finally:
        stop.set()
        for loader in loaders:
            loader.join(90)
        for proc, _ in servers:
            proc.send_signal(signal.SIGTERM)
            proc.wait(30)


def test_rollback_on_a_real_server_from_the_cli_and_the_admin_route(milvus_standalone, starter_bundle, starter_encoder,
                                                                    demo_snapshot, tmp_path):
    """`index versions`, `index activate` and `POST /v1/admin/activate` move the real server's alias, and a
    version the alias left stays loadable: the service serves it again at once (reads at bounded staleness
    would otherwise see the alias where it was)."""
    import json

    from paraseek.core.settings import Settings
    from paraseek.index.builder import update_snapshot
    from paraseek.service.main import create_app

    store = MilvusStore(milvus_standalone.uri, prefix="rollback")
    copy_snapshot(Snapshot.load(demo_snapshot), store)
    first = store.current_version()
    some_id = int(store.load(image_space=Snapshot.load(demo_snapshot).manifest.image_space).contents()[0][0])
    second = update_snapshot(store, starter_encoder, remove=[some_id], progress=False).manifest.version
    milvus = ["--backend", "milvus", "--uri", milvus_standalone.uri, "--collection", "rollback"]

    listed = CliRunner().invoke(app, ["index", "versions", *milvus, "--json"])
    assert listed.exit_code == 0, listed.output
    rows = [json.loads(line) for line in listed.output.splitlines()]
    assert [(r["version"], r["current"], r["count"]) for r in rows] == [(first, False, 76), (second, True, 75)]
    assert rows[1]["parent"] == first

    settings = Settings(bundle=starter_bundle, snapshot=demo_snapshot, home=tmp_path, log_json=False, index_backend="milvus",
                        milvus_uri=milvus_standalone.uri, milvus_collection="rollback", admin_token="t")
    auth = {"Authorization": "Bearer t"}
    with TestClient(create_app(settings)) as c:
        assert c.get("/v1/info").json()["snapshot"]["version"] == second
        r = c.post("/v1/admin/activate", json={"previous": True}, headers=auth)
        assert r.status_code == 200 and (r.json()["version"], r.json()["was"], r.json()["count"]) == (first, second, 76), r.text
        assert store.current_version() == first
        listed = c.get("/v1/admin/versions", headers=auth).json()
        assert listed["backend"] == "milvus" and [(v["version"], v["current"], v["served"], v["count"]) for v in listed["versions"]] == [
            (first, True, True, 76), (second, False, False, 75)]
        found = c.post("/v1/search", json={"query": "a dog on a beach", "k": 76, "expansion": {"method": "none"}}).json()
        assert found["snapshot_version"] == first and some_id in {hit["id"] for hit in found["results"]}
        r = c.post("/v1/admin/activate", json={"version": "v0009-20261122T080000Z"}, headers=auth)
        assert r.status_code == 404 and store.current_version() == first

    moved = CliRunner().invoke(app, ["index", "activate", *milvus, "--version", second])
    assert moved.exit_code == 0, moved.output
    assert store.current_version() == second and len(store.load(image_space=rows[1]["image_space"])) == 75
    third = update_snapshot(store, starter_encoder, remove=[int(store.load(image_space=rows[1]["image_space"]).contents()[0][0])],
                            progress=False).manifest.version
    pruned = CliRunner().invoke(app, ["index", "prune", *milvus, "--keep", "2"])
    assert pruned.exit_code == 0 and "removed 1 version(s)" in pruned.output, pruned.output
    # gone at once from the list and the server: a read at bounded staleness must not bring it back
    assert store.versions() == [second, third] and store.current_version() == third
    assert not store.client.has_collection(store.collection(first))
