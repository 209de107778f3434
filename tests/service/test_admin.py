"""Admin routes: token guard, reindex jobs (success swaps, failure keeps the old snapshot), reload, activate
(rollback)."""

import shutil
import threading
import time

import pytest
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from paraseek.service.jobs import FINISHED
from paraseek.service.main import create_app
from tests.service.conftest import ADMIN_TOKEN

AUTH = {"Authorization": f"Bearer {ADMIN_TOKEN}"}


def wait_job(c, job_id, timeout=120):
    deadline = time.time() + timeout
    while time.time() < deadline:
        job = c.get(f"/v1/admin/jobs/{job_id}", headers=AUTH).json()
        if job["state"] in FINISHED:
            return job
        time.sleep(0.2)
    raise AssertionError("job did not finish")


def three_photos(shared_data, tmp_path):
    """A folder of three COCO photos to reindex: a job quick enough to hold, cancel and finish."""
    root = tmp_path / "root"
    root.mkdir()
    for p in sorted((shared_data / "coco-mini" / "val2017").glob("*.jpg"))[:3]:
        shutil.copy(p, root / p.name)
    return root


def test_admin_disabled_without_token(make_settings):
    with TestClient(create_app(make_settings(admin_token=None))) as c:
        r = c.post("/v1/admin/reindex", json={"source": "x"}, headers=AUTH)
        assert r.status_code == 404 and "disabled" in r.text


@pytest.mark.parametrize("headers, status", [({}, 401), ({"Authorization": "Bearer wrong"}, 403),
                                              ({"Authorization": f"Basic {ADMIN_TOKEN}"}, 401)])
@pytest.mark.quick
def test_admin_requires_the_token(client, headers, status):
    assert client.post("/v1/admin/reindex", json={"source": "x"}, headers=headers).status_code == status
    assert client.get("/v1/admin/jobs/abc", headers=headers).status_code == status
    assert client.post("/v1/admin/reload", json={"bundle": "x"}, headers=headers).status_code == status
    assert client.post("/v1/admin/activate", json={"previous": True}, headers=headers).status_code == status
    assert client.get("/v1/admin/versions", headers=headers).status_code == status
    assert client.post("/v1/admin/jobs/abc/cancel", headers=headers).status_code == status
    assert client.get("/v1/admin/jobs", headers=headers).status_code == status


def test_reindex_swaps_to_new_snapshot(make_settings, snapshot_copy, shared_data):
    with TestClient(create_app(make_settings(snapshot=snapshot_copy, reindex_root=shared_data))) as c:
        before = c.get("/v1/info").json()["snapshot"]
        r = c.post("/v1/admin/reindex", json={"source": str(shared_data / "coco-mini/captions_val2017.json"),
                                              "index_type": "hnsw"}, headers=AUTH)
        assert r.status_code == 202
        job = wait_job(c, r.json()["id"])
        assert job["state"] == "succeeded", job
        assert job["report"]["indexed"] == 159 and job["progress"] == {"phase": "indexing", "done": 159, "total": 159}
        after = c.get("/v1/info").json()["snapshot"]
        assert before["scan_copy_bytes"] == after["scan_copy_bytes"] == 0  # no copy of small or approximate indexes
        assert after["count"] == 159 and after["version"] == job["snapshot_version"] != before["version"]
        assert after["index"]["type"] == "hnsw" and after["recall_at_10"] >= 0.9
        assert (snapshot_copy / "current").read_text().strip() == after["version"]
        assert c.post("/v1/search", json={"query": "a giraffe"}).json()["snapshot_version"] == after["version"]


def test_the_first_version_is_built_through_the_admin_api_of_a_service_not_yet_ready(make_settings, shared_data, tmp_path):
    """A fresh deployment's indexer serves no snapshot (/readyz 503) until a reindex builds the first one
    (deploy/k8s: the paraseek-admin Service reaches it before it is ready)."""
    root = three_photos(shared_data, tmp_path)
    with TestClient(create_app(make_settings(snapshot=tmp_path / "snapshots" / "coco", reindex_root=root))) as c:
        assert c.get("/readyz").status_code == 503
        job = c.post("/v1/admin/reindex", json={"source": str(root)}, headers=AUTH).json()
        done = wait_job(c, job["id"])
        assert done["state"] == "succeeded", done
        ready = c.get("/readyz")
        deadline = time.time() + 120
        while ready.json()["status"] == "warming up" and time.time() < deadline:  # WordNet still loading
            time.sleep(0.5)
            ready = c.get("/readyz")
        assert ready.status_code == 200 and ready.json()["snapshot"] == done["snapshot_version"], ready.json()
        hits = c.post("/v1/search", json={"query": "a photo", "k": 3}).json()["results"]
        assert len(hits) == 3 and c.get("/v1/info").json()["snapshot"]["version"] == done["snapshot_version"]
        watcher = c.app.state.engine._watcher  # retried the load while nothing was served; polling is off
        deadline = time.time() + 30
        while not watcher.done() and time.time() < deadline:
            time.sleep(0.2)
        assert watcher.done() and watcher.exception() is None


def test_a_reindex_encodes_only_what_changed_unless_asked_to_encode_all(make_settings, snapshot_copy, shared_data, tmp_path):
    root = tmp_path / "root"
    root.mkdir()
    photos = sorted((shared_data / "coco-mini" / "val2017").glob("*.jpg"))
    for p in photos[:3]:
        shutil.copy(p, root / p.name)
    with TestClient(create_app(make_settings(snapshot=snapshot_copy, reindex_root=root))) as c:
        def reindex(**extra):
            job = wait_job(c, c.post("/v1/admin/reindex", json={"source": str(root), **extra}, headers=AUTH).json()["id"])
            assert job["state"] == "succeeded", job
            return job

        versions_before = len(list((snapshot_copy / "versions").iterdir()))
        first = reindex()
        assert first["report"]["encoded"] == 3 and first["report"]["reused"] == 0  # the demo's photos are other files
        shutil.copy(photos[3], root / "added.jpg")
        plan = reindex(dry_run=True)  # what the next one would do, with nothing encoded, written or swapped
        assert plan["report"] == {"dry_run": True, "images_total": 4, "refused": 0, "current": first["snapshot_version"],
                                  "unchanged": False, "reuse": 3, "moved": 0, "encode": 1}
        assert plan["snapshot_version"] is None and plan["progress"]["phase"] == "reusing"
        assert len(list((snapshot_copy / "versions").iterdir())) == versions_before + 1
        assert c.get("/v1/info").json()["snapshot"]["version"] == first["snapshot_version"]
        second = reindex()
        assert second["report"]["reused"] == 3 and second["report"]["encoded"] == 1
        assert second["report"]["reused_from"] == first["snapshot_version"] and second["progress"]["done"] == 4
        assert c.get("/v1/info").json()["snapshot"]["version"] == second["snapshot_version"]
        same = reindex()  # nothing changed since: no new version, no swap
        assert same["report"]["unchanged"] and same["snapshot_version"] == second["snapshot_version"]
        assert same["report"]["encoded"] == 0 and len(list((snapshot_copy / "versions").iterdir())) == versions_before + 2
        by_bytes = reindex(checksum=True)  # every photo hashed: the bytes the version recorded, so it stays too
        assert by_bytes["report"]["unchanged"] and by_bytes["snapshot_version"] == second["snapshot_version"]
        kept = reindex(checksum=True, dry_run=True)
        assert kept["report"]["unchanged"] and kept["report"]["current"] == second["snapshot_version"]
        assert kept["progress"] == {"phase": "hashing", "done": 4, "total": 4}
        third = reindex(reuse=False)
        assert third["report"]["reused"] == 0 and third["report"]["encoded"] == 4
        # operators see the work reindexes did (the dashboard's "Reindexed images" panel)
        images = {s.labels["how"]: s.value for f in text_string_to_metric_families(c.get("/metrics").text)
                  for s in f.samples if s.name == "paraseek_reindex_images_total"}
        assert images == {"encoded": 3 + 1 + 4, "reused": 3}  # dry runs encode and reuse nothing
        assert c.post("/v1/admin/reindex", json={"source": str(root), "reuse": "sometimes"},
                      headers=AUTH).status_code == 422
        bad = c.post("/v1/admin/reindex", json={"source": str(root), "checksum": "maybe"}, headers=AUTH)
        assert bad.status_code == 422 and bad.json()["detail"][0]["loc"] == ["body", "checksum"]
        both = c.post("/v1/admin/reindex", json={"source": str(root), "reuse": False, "checksum": True}, headers=AUTH)
        assert both.status_code == 422 and both.json()["detail"][0]["loc"] == ["body", "checksum"]
        assert "goes with reuse true" in both.json()["detail"][0]["msg"]


def test_a_cancelled_reindex_leaves_the_served_version_and_no_new_one(make_settings, snapshot_copy, shared_data,
                                                                     tmp_path, monkeypatch):
    from paraseek.core.encoder import Encoder

    root = three_photos(shared_data, tmp_path)
    encoding, go_on = threading.Event(), threading.Event()
    encode_pixels = Encoder.encode_pixels

    def held(self, pixels):  # the build waits here, mid-encoding, until the test has asked to cancel it
        encoding.set()
        assert go_on.wait(60)
        return encode_pixels(self, pixels)

    monkeypatch.setattr(Encoder, "encode_pixels", held)
    with TestClient(create_app(make_settings(snapshot=snapshot_copy, reindex_root=root))) as c:
        served = c.get("/v1/info").json()["snapshot"]["version"]
        versions = sorted(p.name for p in (snapshot_copy / "versions").iterdir())
        running = c.post("/v1/admin/reindex", json={"source": str(root)}, headers=AUTH).json()
        assert encoding.wait(60)
        queued = c.post("/v1/admin/reindex", json={"source": str(root)}, headers=AUTH).json()  # one build at a time
        r = c.post(f"/v1/admin/jobs/{queued['id']}/cancel", headers=AUTH)
        assert r.status_code == 202 and r.json()["state"] == "cancelled"  # never starts
        r = c.post(f"/v1/admin/jobs/{running['id']}/cancel", headers=AUTH)
        assert r.status_code == 202 and r.json()["state"] == "running"  # stops at its next photo or phase
        go_on.set()
        job = wait_job(c, running["id"])
        assert job["state"] == "cancelled" and job["error"] == "cancelled by an admin request" and job["finished_at"]
        assert job["snapshot_version"] is None and job["progress"]["phase"] == "encoding"
        assert c.get("/v1/info").json()["snapshot"]["version"] == served
        assert sorted(p.name for p in (snapshot_copy / "versions").iterdir()) == versions  # nothing half-written left
        again = c.post(f"/v1/admin/jobs/{running['id']}/cancel", headers=AUTH)
        assert again.status_code == 409 and "already cancelled" in again.text
        assert c.post("/v1/admin/jobs/nosuchjob/cancel", headers=AUTH).status_code == 404
        results = {s.labels["result"]: s.value for f in text_string_to_metric_families(c.get("/metrics").text)
                   for s in f.samples if s.name == "paraseek_reindex_total"}
        assert results == {"succeeded": 0, "failed": 0, "cancelled": 2}
        after = wait_job(c, c.post("/v1/admin/reindex", json={"source": str(root)}, headers=AUTH).json()["id"])
        assert after["state"] == "succeeded" and c.get("/v1/info").json()["snapshot"]["version"] == after["snapshot_version"]
        listed = c.get("/v1/admin/jobs", headers=AUTH).json()  # newest first
        assert [j["id"] for j in listed] == [after["id"], queued["id"], running["id"]] and listed[0] == after
        assert [j["id"] for j in c.get("/v1/admin/jobs?state=cancelled", headers=AUTH).json()] == [queued["id"], running["id"]]
        both = c.get("/v1/admin/jobs?state=succeeded&state=running", headers=AUTH).json()
        assert [j["id"] for j in both] == [after["id"]]
        bad = c.get("/v1/admin/jobs?state=paused", headers=AUTH)
        assert bad.status_code == 422 and bad.json()["detail"][0]["loc"][:2] == ["query", "state"]


def test_a_reindex_cancelled_while_indexing_publishes_nothing(make_settings, snapshot_copy, shared_data, tmp_path,
                                                             monkeypatch):
    """A cancel reaches into the indexing phase: the build stops after the chunk being added, its version
    never written, and the job says how far it had indexed."""
    from paraseek.index import recall, snapshot

    root = three_photos(shared_data, tmp_path)
    indexing, go_on = threading.Event(), threading.Event()
    build = recall.build_faiss_index

    def held(spec, vectors, ids, on_added=None):
        def after_a_chunk(done):
            indexing.set()
            assert go_on.wait(60)
            on_added(done)
        return build(spec, vectors, ids, on_added=after_a_chunk)

    monkeypatch.setattr(recall, "add_chunk_rows", lambda spec: 1)
    monkeypatch.setattr(snapshot, "build_faiss_index", held)
    with TestClient(create_app(make_settings(snapshot=snapshot_copy, reindex_root=root))) as c:
        served = c.get("/v1/info").json()["snapshot"]["version"]
        versions = sorted(p.name for p in (snapshot_copy / "versions").iterdir())
        job = c.post("/v1/admin/reindex", json={"source": str(root)}, headers=AUTH).json()
        assert indexing.wait(60)
        assert c.post(f"/v1/admin/jobs/{job['id']}/cancel", headers=AUTH).json()["state"] == "running"
        go_on.set()
        job = wait_job(c, job["id"])
        assert job["state"] == "cancelled" and job["progress"] == {"phase": "indexing", "done": 0, "total": 3}
        assert c.get("/v1/info").json()["snapshot"]["version"] == served
        assert sorted(p.name for p in (snapshot_copy / "versions").iterdir()) == versions


def test_a_reindex_serves_the_new_versions_hub_table_from_its_swap(make_settings, snapshot_copy, shared_data, starter_bank):
    """With a default hub_weight, a reindex computes the new version's hub table before the swap: the version
    serves lists by table lookup from its first request, and the table is on disk for the other replicas."""
    settings = make_settings(snapshot=snapshot_copy, reindex_root=shared_data, caption_bank=starter_bank.path,
                             default_expansion='{"method": "none", "hub_weight": 0.5}')
    with TestClient(create_app(settings)) as c:
        deadline = time.time() + 60
        while c.get("/v1/info").json()["snapshot"]["hub_table"] != "ready":  # the served version's, built at start
            assert time.time() < deadline, "no hub table at start within 60 s"
            time.sleep(0.1)
        job = wait_job(c, c.post("/v1/admin/reindex", json={"source": str(shared_data / "coco-mini/captions_val2017.json")},
                                 headers=AUTH).json()["id"])
        assert job["state"] == "succeeded", job
        assert job["report"]["hub_table_s"] >= 0  # computed, not read back
        info = c.get("/v1/info").json()["snapshot"]
        assert info["version"] == job["snapshot_version"] and info["hub_table"] == "ready"  # at once, not built after
        assert len(list((settings.home / "hub-tables").glob("*.npz"))) == 2
        assert c.post("/v1/search", json={"query": "a giraffe"}).json()["snapshot_version"] == info["version"]
    with TestClient(create_app(make_settings(snapshot=snapshot_copy))) as c:  # no hub_weight asked for: no table
        assert c.get("/v1/info").json()["snapshot"]["hub_table"] is None


def test_a_prune_failing_after_the_swap_leaves_the_job_succeeded(make_settings, snapshot_copy, shared_data, tmp_path,
                                                                monkeypatch):
    from paraseek.index.snapshot import FaissStore

    def prune(self, keep):
        raise PermissionError("versions/v0001: read-only file system")

    monkeypatch.setattr(FaissStore, "prune", prune)
    root = three_photos(shared_data, tmp_path)
    with TestClient(create_app(make_settings(snapshot=snapshot_copy, reindex_root=root))) as c:
        job = wait_job(c, c.post("/v1/admin/reindex", json={"source": str(root)}, headers=AUTH).json()["id"])
        assert job["state"] == "succeeded" and job["report"]["prune_error"].startswith("PermissionError: versions/v0001")
        assert c.get("/v1/info").json()["snapshot"]["version"] == job["snapshot_version"]


def test_failed_reindex_keeps_old_snapshot(make_settings, snapshot_copy, tmp_path):
    junk = tmp_path / "junk"
    junk.mkdir()
    (junk / "a.jpg").write_text("not an image")
    with TestClient(create_app(make_settings(snapshot=snapshot_copy, reindex_root=tmp_path))) as c:
        before = c.get("/v1/info").json()["snapshot"]["version"]
        job = wait_job(c, c.post("/v1/admin/reindex", json={"source": str(junk)}, headers=AUTH).json()["id"])
        assert job["state"] == "failed" and "could be decoded" in job["error"]
        assert c.get("/v1/info").json()["snapshot"]["version"] == before
        assert (snapshot_copy / "current").read_text().strip() == before
        assert c.post("/v1/search", json={"query": "a dog"}).status_code == 200
        missing = c.post("/v1/admin/reindex", json={"source": str(tmp_path / "nope")}, headers=AUTH)
        assert missing.status_code == 422 and missing.json()["detail"][0]["loc"] == ["body", "source"]


@pytest.mark.quick
def test_reindex_root_confines_sources(make_settings, snapshot_copy, tmp_path):
    with TestClient(create_app(make_settings(snapshot=snapshot_copy, reindex_root=tmp_path / "allowed"))) as c:
        r = c.post("/v1/admin/reindex", json={"source": "/etc"}, headers=AUTH)
        assert r.status_code == 403 and r.json()["detail"][0]["loc"] == ["body", "source"]
        huge = c.post("/v1/admin/reindex", json={"source": str(tmp_path / "allowed/{0..999999999}.tar")}, headers=AUTH)
        assert huge.status_code == 422 and "names more than 100000 shards" in huge.json()["detail"][0]["msg"]


def test_reload_checks_image_space(make_settings, tiny_clip, starter_bundle, tmp_path_factory):
    with TestClient(create_app(make_settings(reindex_root=tmp_path_factory.getbasetemp()))) as client:
        _reload_checks(client, tiny_clip, starter_bundle)


def _reload_checks(client, tiny_clip, starter_bundle):
    r = client.post("/v1/admin/reload", json={"bundle": str(tiny_clip[0])}, headers=AUTH)
    assert r.status_code == 409 and "reindex" in r.json()["detail"][0]["msg"]
    r = client.post("/v1/admin/reload", json={"bundle": str(starter_bundle), "precision": "int8"}, headers=AUTH)
    assert r.status_code == 200 and r.json()["precision"] == "int8"
    assert client.get("/v1/info").json()["bundle"]["precision"] == "int8"
    assert client.post("/v1/search", json={"query": "a dog"}).status_code == 200


def test_replica_follows_current_written_elsewhere(make_settings, snapshot_copy, starter_encoder, shared_data):
    """Another replica (or a CLI job) publishes a new version: this one swaps to it by itself."""
    from paraseek.index.builder import build_snapshot

    with TestClient(create_app(make_settings(snapshot=snapshot_copy, snapshot_poll_s=0.2))) as c:
        before = c.get("/v1/info").json()["snapshot"]
        result = build_snapshot(shared_data / "coco-mini/captions_val2017.json", starter_encoder, snapshot_copy,
                                progress=False)
        deadline = time.time() + 10
        while time.time() < deadline and c.get("/v1/info").json()["snapshot"]["version"] == before["version"]:
            time.sleep(0.1)
        after = c.get("/v1/info").json()["snapshot"]
        assert after["version"] == result.manifest.version and after["count"] == 159
        assert c.post("/v1/search", json={"query": "a giraffe"}).json()["snapshot_version"] == after["version"]


def test_finished_jobs_are_evicted_oldest_first(make_settings, snapshot_copy):
    """Past ``max_jobs`` records, the oldest finished jobs are forgotten; the newest stay readable."""
    from paraseek.service.jobs import JobManager
    from paraseek.service.schemas import ReindexRequest

    with TestClient(create_app(make_settings(snapshot=snapshot_copy))) as c:
        jobs = JobManager(c.app.state.engine, max_jobs=4)
        ids = []
        for i in range(6):  # each fails fast: the source does not exist
            job = jobs.submit_reindex(ReindexRequest(source=f"/nonexistent/{i}"))
            ids.append(job.id)
            deadline = time.time() + 30
            while jobs.get(job.id).state not in ("failed", "succeeded") and time.time() < deadline:
                time.sleep(0.02)
            assert jobs.get(job.id).state == "failed" and "does not exist" in jobs.get(job.id).error
        jobs.shutdown()
        assert len(jobs.jobs) <= 4
        assert jobs.get(ids[0]) is None and jobs.get(ids[-1]) is not None  # oldest gone, newest kept
        assert list(jobs.jobs) == [i for i in ids if i in jobs.jobs]  # the survivors are the most recent


def test_reload_builds_its_encoder_from_the_same_settings(make_settings, starter_bundle):
    with TestClient(create_app(make_settings(encoder_spin=True, encoder_threads=1))) as c:
        engine = c.app.state.engine
        assert engine.active.encoder.spin is True and engine.active.encoder.threads == 1
        r = c.post("/v1/admin/reload", json={"bundle": str(starter_bundle), "precision": "int8"}, headers=AUTH)
        assert r.status_code == 200, r.text
        enc = engine.active.encoder
        assert enc.precision == "int8" and enc.spin is True and enc.threads == 1


@pytest.mark.quick
def test_default_roots_refuse_host_files_alike(client, tmp_path):
    """Without PARASEEK_REINDEX_ROOT, sources must lie under the serving snapshot's own source folder:
    anything else is 403, and a path that exists answers exactly like one that does not."""
    existing = client.post("/v1/admin/reindex", json={"source": "/etc"}, headers=AUTH)
    missing = client.post("/v1/admin/reindex", json={"source": "/etc-does-not-exist"}, headers=AUTH)
    assert existing.status_code == missing.status_code == 403
    assert existing.json() == missing.json() and existing.json()["detail"][0]["loc"] == ["body", "source"]
    assert "/etc" not in existing.text
    bundle = client.post("/v1/admin/reload", json={"bundle": str(tmp_path)}, headers=AUTH)
    assert bundle.status_code == 403 and bundle.json()["detail"][0]["loc"] == ["body", "bundle"]


@pytest.mark.parametrize("route, body, field", [
    ("/v1/admin/reindex", {"source": "/etc\x00x"}, "source"),
    ("/v1/admin/reindex", {"source": "x", "images": "a\x00"}, "images"),
    ("/v1/admin/reload", {"bundle": "a\x00"}, "bundle"),
])
@pytest.mark.quick
def test_nul_bytes_in_admin_paths_are_422(make_settings, tmp_path, route, body, field):
    with TestClient(create_app(make_settings(reindex_root=tmp_path))) as c:
        r = c.post(route, json=body, headers=AUTH)  # JSON carries the NUL as \u0000
        assert r.status_code == 422, r.text
        assert r.json()["detail"][0]["loc"] == ["body", field]


def test_symlink_out_of_the_root_is_not_indexed_or_served(make_settings, snapshot_copy, tmp_path, shared_data):
    """Inside the reindex root, a file symlink pointing outside is skipped and reported, never served."""
    root = tmp_path / "root"
    root.mkdir()
    photos = sorted((shared_data / "coco-mini" / "val2017").glob("*.jpg"))
    shutil.copy(photos[0], root / "inside.jpg")
    outside = tmp_path / "secret.jpg"
    shutil.copy(photos[1], outside)
    (root / "link.jpg").symlink_to(outside)
    with TestClient(create_app(make_settings(snapshot=snapshot_copy, reindex_root=root))) as c:
        job = wait_job(c, c.post("/v1/admin/reindex", json={"source": str(root)}, headers=AUTH).json()["id"])
        assert job["state"] == "succeeded", job
        assert job["report"]["indexed"] == 1
        assert [s["path"] for s in job["report"]["skipped"]] == ["link.jpg"]
        assert "outside" in job["report"]["skipped"][0]["error"]
        assert c.get("/v1/info").json()["snapshot"]["count"] == 1
        # a symlink planted after indexing is not followed when serving either
        (root / "inside.jpg").unlink()
        (root / "inside.jpg").symlink_to(outside)
        only = c.post("/v1/search", json={"query": "a photo", "k": 1}).json()["results"][0]["id"]
        assert c.get(f"/v1/images/{only}").status_code == 404


@pytest.mark.quick
def test_every_member_of_a_shard_pattern_is_checked(make_settings, snapshot_copy, tmp_path):
    """A brace pattern is expanded and each shard checked: '{a,../../outside}' cannot leave the root."""
    root = tmp_path / "root"
    (root / "shards").mkdir(parents=True)
    (root / "shards" / "a.tar").write_bytes(b"")
    (tmp_path / "outside.tar").write_bytes(b"")
    with TestClient(create_app(make_settings(snapshot=snapshot_copy, reindex_root=root))) as c:
        escape = c.post("/v1/admin/reindex", json={"source": f"{root}/shards/{{a,../../outside}}.tar"}, headers=AUTH)
        assert escape.status_code == 403 and escape.json()["detail"][0]["loc"] == ["body", "source"]
        missing = c.post("/v1/admin/reindex", json={"source": f"{root}/shards/{{a,b}}.tar"}, headers=AUTH)
        assert missing.status_code == 422 and missing.json()["detail"][0]["loc"] == ["body", "source"]


def test_the_job_reads_the_resolved_source_and_checks_it_again(make_settings, snapshot_copy, tmp_path, shared_data):
    """The route resolves the source once and the job gets that path; when the job opens it, it must
    still lie inside the root, so a link swapped in after the request was checked is refused."""
    from paraseek.index.image_sources import ImageSourceError, open_source

    root = tmp_path / "root"
    (root / "real").mkdir(parents=True)
    shutil.copy(sorted((shared_data / "coco-mini" / "val2017").glob("*.jpg"))[0], root / "real" / "a.jpg")
    (root / "link").symlink_to(root / "real")
    outside = tmp_path / "outside"
    outside.mkdir()
    shutil.copy(root / "real" / "a.jpg", outside / "b.jpg")
    with TestClient(create_app(make_settings(snapshot=snapshot_copy, reindex_root=root))) as c:
        job = wait_job(c, c.post("/v1/admin/reindex", json={"source": str(root / "link")}, headers=AUTH).json()["id"])
        assert job["state"] == "succeeded", job
        assert c.get("/v1/info").json()["snapshot"]["count"] == 1
    # between the check and the job: the folder the request named becomes a link out of the root
    shutil.rmtree(root / "real")
    (root / "real").symlink_to(outside)
    with pytest.raises(ImageSourceError, match="outside the allowed roots"):
        open_source(root / "real", within=[root])
    with pytest.raises(ImageSourceError, match="outside the allowed roots"):
        open_source(f"{root}/real/{{a,b}}.tar", within=[root])  # the shards would be read through the link
    with TestClient(create_app(make_settings(snapshot=snapshot_copy, reindex_root=root))) as c:
        app_jobs = c.app.state.jobs
        from paraseek.service.schemas import ReindexRequest

        before = c.get("/v1/info").json()["snapshot"]["version"]
        queued = app_jobs.submit_reindex(ReindexRequest(source=str(root / "real")), within=[root])
        job = wait_job(c, queued.id)
        assert job["state"] == "failed" and "outside the allowed roots" in job["error"]
        assert str(outside) not in job["error"]
        assert c.get("/v1/info").json()["snapshot"]["version"] == before


def test_a_reload_during_a_reindex_is_not_reverted(make_settings, snapshot_copy, shared_data, starter_bundle, monkeypatch):
    """Reindex, reload and the watcher each read what is served, work, then swap: the swap states what
    it replaces, so a reload that lands while a reindex builds wins, and the reindex job fails saying
    why, with its version written but not published."""
    import threading

    from paraseek.service import jobs as jobs_module

    building, release = threading.Event(), threading.Event()
    real_build = jobs_module.build_snapshot

    def slow_build(*args, **kwargs):
        building.set()
        assert release.wait(60)
        return real_build(*args, **kwargs)

    monkeypatch.setattr(jobs_module, "build_snapshot", slow_build)
    # the root of the file system: the shared data and the test's bundle are both allowed
    with TestClient(create_app(make_settings(snapshot=snapshot_copy, reindex_root="/"))) as c:
        before = c.get("/v1/info").json()
        assert before["bundle"]["precision"] == "fp32"  # the tests' settings serve fp32
        job_id = c.post("/v1/admin/reindex", json={"source": str(shared_data / "coco-mini/captions_val2017.json")},
                        headers=AUTH).json()["id"]
        assert building.wait(60)
        reload = c.post("/v1/admin/reload", json={"bundle": str(starter_bundle), "precision": "int8"}, headers=AUTH)
        assert reload.status_code == 200, reload.text
        release.set()
        job = wait_job(c, job_id)
        assert job["state"] == "failed" and "StaleSwap" in job["error"] and "changed while this ran" in job["error"]
        after = c.get("/v1/info").json()
        assert after["bundle"]["precision"] == "int8"  # the reload stands
        assert after["snapshot"]["version"] == before["snapshot"]["version"]
        assert (snapshot_copy / "current").read_text().strip() == before["snapshot"]["version"]  # not published


def test_a_running_reindex_says_its_phase_and_writes_each_phase_at_once(make_settings, snapshot_copy, tmp_path,
                                                                         shared_data, monkeypatch):
    """A checksum reindex goes listing, hashing, reusing, encoding, indexing; an operator polling the job
    sees where it is, and its record on disk (what a restarted service reports) has each phase as it
    starts, though progress within a phase is written at most once a second."""
    import json
    import threading

    from paraseek.service import jobs as jobs_module

    root = three_photos(shared_data, tmp_path)
    encoding, release = threading.Event(), threading.Event()
    seen: list[str] = []
    real_build = jobs_module.build_snapshot

    def build_pausing_while_encoding(*args, on_progress, **kwargs):
        def report(phase, done, total):
            on_progress(phase, done, total)
            if phase not in seen:
                seen.append(phase)
                if phase == "encoding":
                    encoding.set()
                    assert release.wait(60)
        return real_build(*args, on_progress=report, **kwargs)

    monkeypatch.setattr(jobs_module, "build_snapshot", build_pausing_while_encoding)
    settings = make_settings(snapshot=snapshot_copy, reindex_root=root)
    with TestClient(create_app(settings)) as c:
        job_id = c.post("/v1/admin/reindex", json={"source": str(root), "checksum": True}, headers=AUTH).json()["id"]
        assert encoding.wait(60)
        running = c.get(f"/v1/admin/jobs/{job_id}", headers=AUTH).json()
        assert running["state"] == "running" and running["progress"] == {"phase": "encoding", "done": 0, "total": 3}
        on_disk = json.loads((settings.jobs_path / f"{job_id}.json").read_text())
        assert on_disk["progress"] == running["progress"]  # the phase changed: written though the hashing was just now
        release.set()
        job = wait_job(c, job_id)
        assert job["state"] == "succeeded" and job["progress"] == {"phase": "indexing", "done": 3, "total": 3}
    assert seen == ["hashing", "reusing", "encoding", "indexing"]


@pytest.mark.quick
def test_job_records_written_before_phases_still_load(tmp_path, make_settings):
    from paraseek.service.schemas import Job

    base = {"id": "a", "kind": "reindex", "state": "succeeded", "created_at": "2026-11-01T00:00:00+00:00"}
    assert Job.model_validate({**base, "progress": {}}).progress is None
    old = Job.model_validate({**base, "progress": {"done": 3, "total": 4}}).progress
    assert old is not None and (old.phase, old.done, old.total) == ("encoding", 3, 4)


def test_a_swap_that_lost_the_race_changes_nothing(client):
    from paraseek.service.errors import StaleSwap
    from paraseek.service.runtime import Active

    engine = client.app.state.engine
    served = engine.active
    stale = Active(served.encoder, served.snapshot)  # what another caller read, then replaced
    engine.swap(stale, replaces=served)
    published = []
    with pytest.raises(StaleSwap):
        engine.swap(Active(served.encoder, served.snapshot), replaces=served, publish=lambda: published.append(1))
    assert engine.active is stale and published == []


def test_activate_rolls_back_and_forward_and_refuses_what_cannot_serve(make_settings, snapshot_copy, starter_encoder):
    import numpy as np

    from paraseek.index.backends import store_from_settings
    from paraseek.index.builder import update_snapshot
    from paraseek.service.deps import engine_of

    first = (snapshot_copy / "current").read_text().strip()
    some_id = int(np.load(snapshot_copy / "versions" / first / "ids.npy")[0])
    second = update_snapshot(snapshot_copy, starter_encoder, remove=[some_id], progress=False).manifest.version
    with TestClient(create_app(make_settings(snapshot=snapshot_copy))) as c:
        assert c.get("/v1/info").json()["snapshot"]["version"] == second
        listed = c.get("/v1/admin/versions", headers=AUTH)
        assert listed.status_code == 200 and listed.json()["backend"] == "faiss"
        assert [(v["version"], v["parent"], v["count"], v["current"], v["served"]) for v in listed.json()["versions"]] == [
            (first, None, 76, False, False), (second, first, 75, True, True)]
        assert str(snapshot_copy) not in listed.text  # an operator's listing, not the server's folders
        store = engine_of(c.app).store
        listed_then_pruned = [*store.versions(), "v0009-20261122T080000Z"]  # `index prune` elsewhere, between the reads
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(store, "versions", lambda: listed_then_pruned)
            assert [v["version"] for v in c.get("/v1/admin/versions", headers=AUTH).json()["versions"]] == [first, second]
        r = c.post("/v1/admin/activate", json={"previous": True}, headers=AUTH)  # the update's parent
        assert r.status_code == 200 and r.json()["version"] == first and r.json()["was"] == second
        listed = c.get("/v1/admin/versions", headers=AUTH).json()["versions"]
        assert [(v["version"], v["current"], v["served"]) for v in listed] == [(first, True, True), (second, False, False)]
        assert r.json()["count"] == c.get("/v1/info").json()["snapshot"]["count"] == len(np.load(snapshot_copy / "versions" / first / "ids.npy"))
        assert c.get("/v1/info").json()["snapshot"]["version"] == first == (snapshot_copy / "current").read_text().strip()
        assert c.post("/v1/search", json={"query": "a dog"}).json()["snapshot_version"] == first
        r = c.post("/v1/admin/activate", json={"previous": True}, headers=AUTH)
        assert r.status_code == 404 and "oldest published version" in r.text and r.json()["detail"][0]["loc"] == ["body", "version"]

        r = c.post("/v1/admin/activate", json={"version": second}, headers=AUTH)  # forward again
        assert r.status_code == 200 and r.json()["was"] == first
        assert c.post("/v1/search", json={"query": "a dog"}).json()["snapshot_version"] == second
        again = c.post("/v1/admin/activate", json={"version": second}, headers=AUTH)
        assert again.status_code == 200 and again.json()["was"] == second
        store_from_settings(make_settings(snapshot=snapshot_copy)).activate(first)  # another writer; this server does not poll
        listed = c.get("/v1/admin/versions", headers=AUTH).json()["versions"]
        assert [(v["version"], v["current"], v["served"]) for v in listed] == [(first, True, False), (second, False, True)]
        assert c.post("/v1/admin/activate", json={"version": second}, headers=AUTH).json()["was"] == second
        assert (snapshot_copy / "current").read_text().strip() == second  # served, and current again

        for body, status in (({"version": "v0009-20261122T080000Z"}, 404), ({}, 422), ({"version": "../../etc"}, 422),
                             ({"version": second, "previous": True}, 422), ({"version": 3}, 422)):
            r = c.post("/v1/admin/activate", json=body, headers=AUTH)
            assert r.status_code == status, (body, r.text)
        with open(snapshot_copy / "versions" / first / "index.faiss", "ab") as f:  # an altered version
            f.write(b"tampered")
        r = c.post("/v1/admin/activate", json={"version": first}, headers=AUTH)
        assert r.status_code == 409 and "cannot be served" in r.text and str(snapshot_copy) not in r.text
        assert c.get("/v1/info").json()["snapshot"]["version"] == second == (snapshot_copy / "current").read_text().strip()
        assert c.post("/v1/search", json={"query": "a dog"}).status_code == 200


@pytest.mark.parametrize("backend", ["milvus"])
def test_activate_moves_a_milvus_alias(make_settings, starter_encoder, backend):
    from paraseek.index.backends import store_from_settings
    from paraseek.index.builder import update_snapshot

    settings = make_settings()  # the demo's version copied into a collection prefix of this test's own
    store = store_from_settings(settings)
    first = store.current_version()
    some_id = int(store.load(use_gpu=False).contents()[0][0])
    second = update_snapshot(store, starter_encoder, remove=[some_id], progress=False).manifest.version
    with TestClient(create_app(settings)) as c:
        assert c.get("/v1/info").json()["snapshot"]["version"] == second
        r = c.post("/v1/admin/activate", json={"previous": True}, headers=AUTH)
        assert r.status_code == 200 and r.json()["version"] == first, r.text
        assert store.current_version() == first and c.get("/v1/info").json()["snapshot"]["backend"] == "milvus"
        listed = c.get("/v1/admin/versions", headers=AUTH).json()
        assert listed["backend"] == "milvus" and [(v["version"], v["current"], v["served"]) for v in listed["versions"]] == [
            (first, True, True), (second, False, False)]
        assert c.post("/v1/search", json={"query": "a dog"}).json()["snapshot_version"] == first


def test_a_rollback_does_not_wait_for_a_hub_table(make_settings, snapshot_copy, starter_encoder, starter_bank, monkeypatch):
    """With a default hub_weight, a version whose table was never written is swapped in at once and its table
    built on the service's hub-table thread afterwards; a table already written is read back before the swap."""
    import threading

    import numpy as np

    from paraseek.index.builder import update_snapshot
    from paraseek.paraphrase.hub_table import HubTable

    first = (snapshot_copy / "current").read_text().strip()
    some_id = int(np.load(snapshot_copy / "versions" / first / "ids.npy")[0])
    second = update_snapshot(snapshot_copy, starter_encoder, remove=[some_id], progress=False).manifest.version
    computed_on = []
    real = HubTable.compute.__func__

    def recording(cls, bank, contents):
        computed_on.append(threading.current_thread().name)
        return real(cls, bank, contents)

    monkeypatch.setattr(HubTable, "compute", classmethod(recording))
    settings = make_settings(snapshot=snapshot_copy, caption_bank=starter_bank.path,
                             default_expansion='{"method": "none", "hub_weight": 0.5}')

    def served_with_table(c, version):
        deadline = time.time() + 60
        while (info := c.get("/v1/info").json()["snapshot"])["version"] != version or info["hub_table"] != "ready":
            assert time.time() < deadline, info
            time.sleep(0.1)

    with TestClient(create_app(settings)) as c:
        served_with_table(c, second)
        assert computed_on == ["hub-table"]  # the served version's, at start
        r = c.post("/v1/admin/activate", json={"previous": True}, headers=AUTH)
        assert r.status_code == 200 and r.json()["version"] == first
        served_with_table(c, first)
        assert computed_on == ["hub-table", "hub-table"]  # after the swap, on the service's thread, not the request's
        assert c.post("/v1/admin/activate", json={"version": second}, headers=AUTH).status_code == 200
        assert c.get("/v1/info").json()["snapshot"]["hub_table"] == "ready"  # read back before the swap
        assert computed_on == ["hub-table", "hub-table"]


class HeldLock:
    """The engine's swap lock, held by "a job" until ``release()``; ``waiting`` is set once a swap asks for it."""

    def __init__(self):
        self.lock, self.waiting = threading.Lock(), threading.Event()
        self.lock.acquire()

    def __enter__(self):
        self.waiting.set()
        self.lock.acquire()

    def __exit__(self, *exc):
        self.lock.release()

    def release(self):
        if self.lock.locked():
            self.lock.release()


@pytest.mark.quick
def test_a_reload_waiting_for_the_swap_lock_leaves_the_event_loop_answering(make_settings, starter_bundle):
    with TestClient(create_app(make_settings(bundle=starter_bundle))) as c:
        held = HeldLock()  # a reindex publishing its version (a Milvus alias switch can take seconds)
        c.app.state.engine._swap_lock = held
        answers = {}

        def call(name, *args, **kwargs):
            answers[name] = (c.post if kwargs.get("json") else c.get)(*args, **kwargs)

        reload = threading.Thread(target=call, args=("reload", "/v1/admin/reload"),
                                  kwargs={"json": {"bundle": str(starter_bundle)}, "headers": AUTH})
        reload.start()
        try:
            assert held.waiting.wait(60)  # the reload is at the swap
            search = threading.Thread(target=call, args=("search", "/v1/search"), kwargs={"json": {"query": "a dog", "k": 1}})
            search.start()
            search.join(20)
            assert not search.is_alive() and answers["search"].status_code == 200  # the event loop kept answering
            assert reload.is_alive()
        finally:
            held.release()
        reload.join(60)
        assert answers["reload"].status_code == 200, answers["reload"].text
