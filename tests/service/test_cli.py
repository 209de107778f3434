"""``paraseek admin`` against a real service on loopback: what an operator's shell sees, and its exit codes."""

import json

from typer.testing import CliRunner

from paraseek.cli import app
from tests.service.conftest import ADMIN_TOKEN


def admin(url, *args, token=ADMIN_TOKEN):
    env = {"PARASEEK_URL": url, "PARASEEK_ADMIN_TOKEN": token}
    return CliRunner().invoke(app, ["admin", *args], env=env)


def test_reindex_follow_list_and_roll_back_from_a_shell(uvicorn_server, snapshot_copy, shared_data):
    url = uvicorn_server(snapshot_copy, PARASEEK_REINDEX_ROOT=shared_data)
    source = str(shared_data / "coco-mini/captions_val2017.json")
    before = json.loads(admin(url, "versions", "--json").stdout)["versions"]

    plan = admin(url, "reindex", source, "--dry-run", "--wait", "--poll", "0.1")
    assert plan.exit_code == 0, plan.output
    assert "dry run: 159 images;" in plan.stdout and "would be encoded into a new version" in plan.stdout

    done = admin(url, "reindex", source, "--type", "hnsw", "--params", '{"hnsw_m": 16}', "--wait", "--poll", "0.1")
    assert done.exit_code == 0, done.output
    assert "job " in done.stderr and "running: encoding" in done.stderr  # the phases, as they came
    job = json.loads(admin(url, "jobs", "--json", "--state", "succeeded").stdout)[0]  # newest first
    assert f"job {job['id']} succeeded: serving {job['snapshot_version']}, 159 images indexed" in done.stdout
    assert job["report"]["indexed"] == 159

    table = admin(url, "versions")
    assert table.exit_code == 0
    line = next(row for row in table.stdout.splitlines() if job["snapshot_version"] in row)
    assert line.startswith("*>") and " 159 " in line and "hnsw" in line

    back = admin(url, "activate", "--previous")
    assert back.exit_code == 0 and back.stdout.startswith(f"serving {before[0]['version']}") and job["snapshot_version"] in back.stdout

    ended = admin(url, "cancel", job["id"])
    assert ended.exit_code == 2 and "already succeeded" in ended.stderr

    listed = admin(url, "jobs")
    assert listed.exit_code == 0 and listed.stdout.splitlines()[0].startswith(job["id"])
    assert admin(url, "job", job["id"]).stdout.startswith(f"job {job['id']} succeeded")

    failed = admin(url, "reindex", str(shared_data / "sts"), "--wait", "--poll", "0.1")  # no photos there
    assert failed.exit_code == 1 and "failed: " in failed.stderr and "still serves its previous version" in failed.stderr


def test_refusals_and_outages_exit_as_documented(uvicorn_server, demo_snapshot, tmp_path):
    from paraseek.loadtests.net import free_port

    url = uvicorn_server(demo_snapshot)
    wrong = admin(url, "jobs", token="not-the-token")
    assert wrong.exit_code == 2 and "wrong admin token" in wrong.stderr
    outside = admin(url, "reindex", str(tmp_path))
    assert outside.exit_code == 2 and "source is not under an allowed root" in outside.stderr
    bad_type = admin(url, "reindex", str(tmp_path), "--type", "bogus")
    assert bad_type.exit_code == 2 and "--type/--params" in bad_type.stderr
    neither = admin(url, "activate")
    assert neither.exit_code == 2 and "VERSION or --previous" in neither.stderr
    no_token = admin(url, "jobs", token="")
    assert no_token.exit_code == 2 and "no admin token" in no_token.stderr
    down = admin(f"http://127.0.0.1:{free_port()}", "jobs")
    assert down.exit_code == 69 and "did not answer" in down.stderr
    flags = CliRunner().invoke(app, ["admin", "jobs", "--url", url, "--token", ADMIN_TOKEN, "--json"])  # or as flags of the command
    assert flags.exit_code == 0 and json.loads(flags.stdout) == []


def test_cancel_waits_until_a_running_reindex_has_stopped(make_settings, snapshot_copy, shared_data, monkeypatch):
    """In this process (the build is held until the cancel was asked): the command returns once the job has
    stopped, and the job then reads as cancelled (exit 1 for `job`, which did not succeed)."""
    import threading

    from fastapi.testclient import TestClient

    from paraseek.service import cli, jobs
    from paraseek.service.admin_client import AdminClient
    from paraseek.service.main import create_app

    asked, build = threading.Event(), jobs.build_snapshot

    def held_build(*args, **kwargs):
        assert asked.wait(60)
        return build(*args, **kwargs)

    monkeypatch.setattr(jobs, "build_snapshot", held_build)
    with TestClient(create_app(make_settings(snapshot=snapshot_copy, reindex_root=shared_data))) as c:
        class ThroughTheApp(AdminClient):
            def __init__(self, url, token, timeout):
                super().__init__(url, token, client=c)

            def cancel(self, job_id):
                answer = super().cancel(job_id)
                asked.set()  # the build goes on to its first progress report, where it stops
                return answer

            def close(self):
                pass  # the test's client outlives each command

        monkeypatch.setattr(cli, "AdminClient", ThroughTheApp)
        served = c.get("/v1/info").json()["snapshot"]["version"]
        started = admin(str(c.base_url), "reindex", str(shared_data / "coco-mini/captions_val2017.json"), "--json")
        job_id = json.loads(started.stdout)["id"]
        stopped = admin(str(c.base_url), "cancel", job_id, "--wait")
        assert stopped.exit_code == 0, stopped.output
        assert stopped.stdout.startswith(f"job {job_id} cancelled; the service still serves its previous version")
        after = admin(str(c.base_url), "job", job_id)
        assert after.exit_code == 1 and "cancelled: cancelled by an admin request" in after.stderr
        assert c.get("/v1/info").json()["snapshot"]["version"] == served
