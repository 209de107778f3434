"""``AdminClient`` against the app in this process: what it returns, and how refusals and outages come back."""

import threading

import pytest
from fastapi.testclient import TestClient

from paraseek.core.errors import Unavailable, UserError
from paraseek.service.admin_client import AdminClient, AdminRequestError
from paraseek.service.main import create_app
from tests.service.conftest import ADMIN_TOKEN


def admin_of(c: TestClient, token: str | None = ADMIN_TOKEN) -> AdminClient:
    return AdminClient(str(c.base_url), token, client=c)


def test_a_reindex_waited_for_is_served_and_rolled_back(make_settings, snapshot_copy, shared_data):
    with TestClient(create_app(make_settings(snapshot=snapshot_copy, reindex_root=shared_data))) as c:
        admin = admin_of(c)
        served = admin.versions()
        assert [v["served"] for v in served["versions"]] == [True]
        started = admin.reindex(str(shared_data / "coco-mini/captions_val2017.json"), index_type="flat", images=None)
        assert started["state"] in ("queued", "running")
        seen = []
        job = admin.wait(started["id"], poll_s=0.05, on_update=seen.append)
        assert job["state"] == "succeeded" and seen[-1] == job and job["report"]["indexed"] == 159
        assert {s["state"] for s in seen} <= {"queued", "running", "succeeded"}
        assert admin.jobs() == [job] and admin.jobs(["failed", "cancelled"]) == []
        versions = {v["version"]: v for v in admin.versions()["versions"]}
        assert versions[job["snapshot_version"]]["served"] and versions[job["snapshot_version"]]["current"]
        back = admin.activate(previous=True)
        assert back["was"] == job["snapshot_version"] and back["version"] == served["versions"][0]["version"]
        assert c.get("/v1/info").json()["snapshot"]["version"] == back["version"]
        with pytest.raises(AdminRequestError, match="already succeeded") as refused:
            admin.cancel(job["id"])
        assert refused.value.status == 409 and isinstance(refused.value, UserError)


def test_refusals_carry_the_services_message_and_field(make_settings, starter_bundle):
    with TestClient(create_app(make_settings())) as c:
        assert admin_of(c).reload(str(starter_bundle), "fp32") == {"bundle": "paraseek-starter", "version": "3", "precision": "fp32"}
        with pytest.raises(AdminRequestError, match="wrong admin token") as wrong:
            admin_of(c, "not-the-token").jobs()
        assert wrong.value.status == 403
        with pytest.raises(AdminRequestError, match="missing bearer token"):
            admin_of(c, None).jobs()
        admin = admin_of(c)
        with pytest.raises(AdminRequestError, match=r"body\.index_type: Input should be 'auto'"):
            admin.reindex("x", index_type="bogus")
        with pytest.raises(AdminRequestError, match=r"query\.state"):
            admin.jobs(["paused"])
        with pytest.raises(AdminRequestError, match="no job nosuchjob") as missing:
            admin.job("nosuchjob")
        assert missing.value.status == 404
        with pytest.raises(AdminRequestError, match="give version or previous"):
            admin.activate(None)
    with TestClient(create_app(make_settings(admin_token=None))) as c:
        with pytest.raises(AdminRequestError, match="started without PARASEEK_ADMIN_TOKEN"):
            admin_of(c).jobs()


def test_waiting_gives_up_at_its_timeout_and_the_job_goes_on(make_settings, snapshot_copy, shared_data, monkeypatch):
    from paraseek.service import jobs

    release = threading.Event()
    build = jobs.build_snapshot

    def held_build(*args, **kwargs):
        assert release.wait(60)
        return build(*args, **kwargs)

    monkeypatch.setattr(jobs, "build_snapshot", held_build)
    with TestClient(create_app(make_settings(snapshot=snapshot_copy, reindex_root=shared_data))) as c:
        admin = admin_of(c)
        job = admin.reindex(str(shared_data / "coco-mini/captions_val2017.json"))
        with pytest.raises(TimeoutError, match="still running after 0.3 s"):
            admin.wait(job["id"], poll_s=0.05, timeout_s=0.3)
        release.set()
        assert admin.wait(job["id"], poll_s=0.05)["state"] == "succeeded"


@pytest.mark.quick
def test_a_service_that_does_not_answer_is_unavailable():
    from paraseek.loadtests.net import free_port

    with AdminClient(f"http://127.0.0.1:{free_port()}", ADMIN_TOKEN, timeout=2) as admin:
        with pytest.raises(Unavailable, match="did not answer"):
            admin.jobs()
