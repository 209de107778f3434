"""The service over a real uvicorn on loopback, with a real redis-server."""

import json
import threading
import time

import httpx
import pytest

from tests.conftest import BACKENDS, MILVUS_SERVER
from tests.service.conftest import ADMIN_TOKEN, milvus_env

AUTH = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
# Milvus in a process of its own: Milvus Lite's gRPC server, or a real Milvus 2.3.5 standalone server
MILVUS_PROCESSES = ["milvus-lite-server", MILVUS_SERVER]


@pytest.fixture(scope="module")
def milvus_standalone(own_milvus_standalone):
    """This module stops and restarts the server: one of its own, not the run's shared one."""
    return own_milvus_standalone


@pytest.fixture()
def milvus_outside(request) -> dict:
    """``uri``, ``stop()`` and ``start()`` of the Milvus process the test is parametrised with: Milvus
    Lite's server (stop: kill -9) or the module's standalone server (stop: SIGTERM, so a restart)."""
    if request.param == MILVUS_SERVER:
        server = request.getfixturevalue("milvus_standalone")
        return {"uri": server.uri, "stop": server.stop, "start": server.start}
    return request.getfixturevalue("milvus_server")


def test_redis_cache_and_redis_killed_mid_run(uvicorn_server, demo_snapshot, redis_server):
    url = uvicorn_server(demo_snapshot, PARASEEK_REDIS_URL=redis_server["url"], PARASEEK_REDIS_RETRY_AFTER_S=0.5)
    with httpx.Client(base_url=url, timeout=10) as c:
        assert c.get("/v1/info").json()["cache"] == "redis"
        a = c.post("/v1/search", json={"query": "a train at a station"}).json()
        b = c.post("/v1/search", json={"query": "a train at a station"}).json()
        assert a["cache"] == "miss" and b["cache"] == "hit" and a["results"] == b["results"]
        redis_server["proc"].kill()
        redis_server["proc"].wait()
        statuses = [c.post("/v1/search", json={"query": f"a bicycle number {i}"}).status_code for i in range(20)]
        assert statuses == [200] * 20
        again = c.post("/v1/search", json={"query": "a train at a station"})
        assert again.status_code == 200 and again.json()["results"] == a["results"]
        metrics = c.get("/metrics").text
        errors = [float(line.split()[-1]) for line in metrics.splitlines() if line.startswith("paraseek_cache_errors_total")]
        assert errors and errors[0] >= 1


@pytest.mark.parametrize("backend", [*BACKENDS, MILVUS_SERVER])
def test_reindex_swap_under_concurrent_queries(uvicorn_server, snapshot_copy, shared_data, backend, request):
    """No query fails while a reindex builds and swaps: on FAISS, on Milvus Lite's server process and on
    a real Milvus standalone server (the alias moves)."""
    env = {}
    if backend != "faiss":
        uri = request.getfixturevalue("milvus_standalone").uri if backend == MILVUS_SERVER else request.getfixturevalue("milvus_server")["uri"]
        env = milvus_env(uri, snapshot_copy)
    url = uvicorn_server(snapshot_copy, PARASEEK_REINDEX_ROOT=shared_data, **env)
    failures, answered, versions = [], [0], set()
    stop = threading.Event()

    def hammer(i):
        with httpx.Client(base_url=url, timeout=30) as c:
            n = 0
            while not stop.is_set():
                r = c.post("/v1/search", json={"query": f"people on a street {i} {n}", "k": 5})
                n += 1
                if r.status_code != 200:
                    failures.append((r.status_code, r.text[:200]))
                else:
                    answered[0] += 1
                    versions.add(r.json()["snapshot_version"])

    threads = [threading.Thread(target=hammer, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    try:
        with httpx.Client(base_url=url, timeout=30) as c:
            before = c.get("/v1/info").json()["snapshot"]["version"]
            job_id = c.post("/v1/admin/reindex", json={"source": str(shared_data / "coco-mini/captions_val2017.json")},
                            headers=AUTH).json()["id"]
            deadline = time.time() + 180
            while time.time() < deadline:
                job = c.get(f"/v1/admin/jobs/{job_id}", headers=AUTH).json()
                if job["state"] in ("succeeded", "failed"):
                    break
                time.sleep(0.3)
            time.sleep(1.0)  # keep querying the new snapshot for a moment
    finally:
        stop.set()
        for t in threads:
            t.join()
    assert job["state"] == "succeeded", job
    assert failures == []
    assert answered[0] > 20
    assert before in versions and job["snapshot_version"] in versions
    with httpx.Client(base_url=url, timeout=30) as c:
        assert c.get("/v1/info").json()["snapshot"]["backend"] == ("faiss" if backend == "faiss" else "milvus")


def test_structured_logs_carry_request_ids(uvicorn_server, demo_snapshot, tmp_path):
    url = uvicorn_server(demo_snapshot)
    with httpx.Client(base_url=url, timeout=10) as c:
        r = c.post("/v1/search", json={"query": "a boat"}, headers={"x-request-id": "req-123"})
        assert r.headers["x-request-id"] == "req-123"
    time.sleep(0.3)
    lines = [json.loads(line) for log in tmp_path.glob("server-*.log") for line in log.read_text().splitlines()
             if line.startswith("{")]
    assert any(entry.get("request_id") == "req-123" and entry.get("route") == "/v1/search" for entry in lines)


def test_kill_9_during_reindex_leaves_nothing_behind(uvicorn_server, snapshot_copy, shared_data):
    """A server killed mid-build: on restart the staging folder is gone, the old version still serves,
    and the job is reported as failed (interrupted) instead of being forgotten."""
    url = uvicorn_server(snapshot_copy, PARASEEK_REINDEX_ROOT=shared_data)
    before = (snapshot_copy / "current").read_text().strip()
    with httpx.Client(base_url=url, timeout=30) as c:
        job_id = c.post("/v1/admin/reindex", json={"source": str(shared_data / "coco-mini/captions_val2017.json")},
                        headers=AUTH).json()["id"]
        deadline = time.time() + 60
        while time.time() < deadline and not list((snapshot_copy / "versions").glob(".tmp-*")):
            time.sleep(0.05)
        assert list((snapshot_copy / "versions").glob(".tmp-*")), "the build never started"
    proc = uvicorn_server.procs[-1]
    proc.kill()  # SIGKILL: no cleanup code runs
    proc.wait()
    assert list((snapshot_copy / "versions").glob(".tmp-*"))  # left behind by the kill

    url = uvicorn_server(snapshot_copy, PARASEEK_REINDEX_ROOT=shared_data)
    assert not list((snapshot_copy / "versions").glob(".tmp-*"))
    assert (snapshot_copy / "current").read_text().strip() == before
    with httpx.Client(base_url=url, timeout=30) as c:
        job = c.get(f"/v1/admin/jobs/{job_id}", headers=AUTH)
        assert job.status_code == 200 and job.json()["state"] == "failed" and "interrupted" in job.json()["error"]
        assert c.post("/v1/search", json={"query": "a dog"}).json()["snapshot_version"] == before


@pytest.mark.parametrize("milvus_outside", MILVUS_PROCESSES, indirect=True)
def test_milvus_outage_is_a_503_and_the_service_recovers(uvicorn_server, demo_snapshot, milvus_outside):
    milvus_server = milvus_outside
    url = uvicorn_server(demo_snapshot, **milvus_env(milvus_server["uri"], demo_snapshot), PARASEEK_MILVUS_TIMEOUT_S=2)
    with httpx.Client(base_url=url, timeout=30) as c:
        ok = c.post("/v1/search", json={"query": "a dog on a beach", "k": 5})
        assert ok.status_code == 200 and ok.json()["results"]
        milvus_server["stop"]()  # the database goes away
        down = c.post("/v1/search", json={"query": "a cat on a sofa", "k": 5})
        assert down.status_code == 503, down.text
        detail = down.json()["detail"][0]
        assert detail["loc"] == ["index"] and "milvus" in detail["msg"] and "unavailable" in detail["msg"]
        assert down.headers["retry-after"] and milvus_server["uri"] not in down.text
        auth = {"Authorization": f"Bearer {ADMIN_TOKEN}"}  # an operator's rollback meets the same outage
        for r in (c.get("/v1/admin/versions", headers=auth), c.post("/v1/admin/activate", json={"previous": True}, headers=auth)):
            assert r.status_code == 503 and r.json()["detail"][0]["loc"] == ["index"] and r.headers["retry-after"], r.text
        assert c.get("/healthz").status_code == 200  # the process itself lives on
        milvus_server["start"]()
        # a restarted server reloads its collections itself (about 30 s for Milvus 2.3.5); until then
        # the service answers 503 and retries the load itself
        deadline, status = time.time() + 120, None
        while time.time() < deadline and status != 200:
            r = c.post("/v1/search", json={"query": "a cat on a sofa", "k": 5})
            status = r.status_code
            assert status in (200, 503), r.text
            time.sleep(0.3)
        assert status == 200 and r.json()["results"]


@pytest.mark.parametrize("milvus_outside", MILVUS_PROCESSES, indirect=True)
def test_kill_9_during_a_milvus_reindex_leaves_the_alias_and_nothing_behind(uvicorn_server, snapshot_copy, shared_data,
                                                                             milvus_outside):
    from paraseek.index.milvus_store import MilvusStore

    milvus_server = milvus_outside

    env = milvus_env(milvus_server["uri"], snapshot_copy)
    url = uvicorn_server(snapshot_copy, PARASEEK_REINDEX_ROOT=shared_data, **env)
    store = MilvusStore(milvus_server["uri"], prefix=env["PARASEEK_MILVUS_COLLECTION"])
    before = store.current_version()
    with httpx.Client(base_url=url, timeout=30) as c:
        c.post("/v1/admin/reindex", json={"source": str(shared_data / "coco-mini/captions_val2017.json")}, headers=AUTH)
        deadline = time.time() + 60
        while time.time() < deadline and not [r for r in store._rows("building")]:
            time.sleep(0.05)
        assert store._rows("building"), "the build never started"
    proc = uvicorn_server.procs[-1]
    proc.kill()
    proc.wait()
    assert store._rows("building") and store.current_version() == before

    url = uvicorn_server(snapshot_copy, PARASEEK_REINDEX_ROOT=shared_data, **env)
    assert not store._rows("building") and store.versions() == [before] and store.current_version() == before
    with httpx.Client(base_url=url, timeout=30) as c:
        assert c.post("/v1/search", json={"query": "a dog"}).json()["snapshot_version"] == before
