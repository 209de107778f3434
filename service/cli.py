"""``paraseek admin``: a running service's admin API from a shell (``AdminClient``): reindex and wait,
follow, list and cancel jobs, list versions, roll back, reload a bundle. Paths are the server's, read
by the server. Exit codes: 0 done, 1 a job that ended failed or cancelled, 2 a request the service
refused (its message says which field), 69 a service that did not answer (retry later).

A thin client: the index's helpers (its checks and tables) are imported by the commands that print or check
with them, so most commands start without the index (numpy, faiss)."""

from __future__ import annotations

import json
from datetime import datetime
from typing import List, Optional

import typer

from paraseek.core.cli_support import console, err, user_errors
from paraseek.core.errors import UserError
from paraseek.service.admin_client import AdminClient
from paraseek.service.job_states import FINISHED

app = typer.Typer(help="Drive a running service's admin API (PARASEEK_URL, PARASEEK_ADMIN_TOKEN): reindex, jobs, "
                  "versions, rollback, reload.", no_args_is_help=True)

EXIT_JOB_DID_NOT_SUCCEED = 1
URL_OPTION = typer.Option("http://127.0.0.1:8000", "--url", envvar="PARASEEK_URL", help="The service's base URL.")
TOKEN_OPTION = typer.Option(None, "--token", envvar="PARASEEK_ADMIN_TOKEN", show_default=False,
                            help="The service's admin token (its PARASEEK_ADMIN_TOKEN; the variable keeps it out of "
                            "process listings, which show a flag).")
TIMEOUT_OPTION = typer.Option(30.0, "--timeout", min=0.1, help="Seconds to wait for each answer.")


def client(url: str, token: str | None, timeout: float) -> AdminClient:
    if not token:
        raise UserError("no admin token: give --token or set PARASEEK_ADMIN_TOKEN (the service's)")
    return AdminClient(url.rstrip("/"), token, timeout=timeout)


JSON_OPTION = typer.Option(False, "--json", help="Print the service's JSON answer as it is.")
WAIT_OPTION = typer.Option(False, "--wait/--no-wait", help="Follow the job until it ends (exit 1 unless it succeeded); Ctrl-C stops "
                           "following, not the job.")
POLL_OPTION = typer.Option(1.0, "--poll", min=0.05, help="With --wait: seconds between polls.")
WAIT_TIMEOUT_OPTION = typer.Option(None, "--wait-timeout", min=0.0, help="With --wait: stop following after this many seconds.")


def print_json(value) -> None:
    console.print_json(json.dumps(value), indent=None)


def _where(job: dict) -> str:
    """A queued or running job's phase and count, e.g. "encoding 40/159"."""
    p = job.get("progress") or {}
    counted = f" {p.get('done', 0)}/{p['total']}" if p.get("total") is not None else ""
    return f"{p.get('phase', 'queued')}{counted}"


def _progress_line(job: dict) -> str:
    return f"{job['state']}: {_where(job)}"


def follow(admin: AdminClient, job_id: str, poll_s: float, timeout_s: float | None) -> dict:
    """Wait for the job, saying each phase it enters on stderr."""
    last: tuple = ()  # the (state, phase) said last

    def on_update(job: dict) -> None:
        nonlocal last
        phase = (job["state"], (job.get("progress") or {}).get("phase"))
        if job["state"] in FINISHED or phase == last:
            return
        last = phase
        err.print(f"job {job_id} {_progress_line(job)}", highlight=False, soft_wrap=True)

    try:
        return admin.wait(job_id, poll_s=poll_s, timeout_s=timeout_s, on_update=on_update)
    except TimeoutError as exc:
        raise UserError(f"{exc}: `paraseek admin job {job_id} --wait` follows it again") from None
    except KeyboardInterrupt:
        err.print(f"stopped following; job {job_id} goes on (`paraseek admin cancel {job_id}` stops it)", highlight=False,
                  soft_wrap=True)
        raise typer.Exit(130) from None


def _took(job: dict) -> str:
    """From the request to the end, queueing included (the report's seconds count the encoding only)."""
    if not job.get("finished_at"):
        return ""
    seconds = (datetime.fromisoformat(job["finished_at"]) - datetime.fromisoformat(job["created_at"])).total_seconds()
    return f"in {seconds:.1f} s"


def print_job(job: dict) -> None:
    """A job as one line (and its skipped files on stderr); exits 1 when it ended failed or cancelled."""
    report = job.get("report") or {}
    state = job["state"]
    if state == "succeeded" and report.get("dry_run"):
        from paraseek.index.cli import print_plan

        print_plan(report)
    elif state == "succeeded" and report.get("unchanged"):
        console.print(f"job {job['id']} succeeded: nothing changed since {job['snapshot_version']} was built; it stays "
                      f"served ({report.get('images_total')} images)", soft_wrap=True, highlight=False)
    elif state == "succeeded":
        reused = f", {report['reused']} reused from {report['reused_from']}" if report.get("reused") else ""
        console.print(f"job {job['id']} succeeded: serving {job['snapshot_version']}, {report.get('indexed')} images indexed "
                      f"({report.get('encoded')} encoded{reused}) {_took(job)}", soft_wrap=True, highlight=False)
    elif state in ("failed", "cancelled"):
        err.print(f"job {job['id']} {state}: {job.get('error')}; the service still serves its previous version",
                  soft_wrap=True, highlight=False)
    else:
        console.print(f"job {job['id']} {_progress_line(job)}", highlight=False, soft_wrap=True)
    for item in report.get("skipped") or []:
        err.print(f"skipped {item['path']}: {item['error']}", highlight=False, soft_wrap=True)
    if state in ("failed", "cancelled"):
        raise typer.Exit(EXIT_JOB_DID_NOT_SUCCEED)


def show(job: dict, as_json: bool) -> None:
    if as_json:
        print_json(job)
        if job["state"] in ("failed", "cancelled"):
            raise typer.Exit(EXIT_JOB_DID_NOT_SUCCEED)
    else:
        print_job(job)


@app.command("reindex")
@user_errors
def reindex_cmd(
    source: str = typer.Argument(..., help="Image folder or COCO JSON on the server (under its PARASEEK_REINDEX_ROOT)."),
    images: Optional[str] = typer.Option(None, help="Image folder of a COCO JSON, on the server."),
    bundle: Optional[str] = typer.Option(None, help="Bundle folder on the server (default: the serving bundle)."),
    index_type: str = typer.Option("auto", "--type", help="auto | flat | hnsw | ivf_flat | ivf_fp16 | ivf_pq (as `index build`)."),
    params: Optional[str] = typer.Option(None, help='Index parameters as JSON, e.g. \'{"hnsw_m": 32}\'.'),
    reuse: bool = typer.Option(True, "--reuse/--reencode", help="Keep the vectors of unchanged files (as `index build`)."),
    checksum: bool = typer.Option(False, help="Compare photos by their bytes, not size and modification time."),
    dry_run: bool = typer.Option(False, help="Only say what the reindex would do: nothing encoded, written or swapped."),
    wait: bool = WAIT_OPTION,
    poll: float = POLL_OPTION,
    wait_timeout: Optional[float] = WAIT_TIMEOUT_OPTION,
    as_json: bool = JSON_OPTION,
    url: str = URL_OPTION,
    token: Optional[str] = TOKEN_OPTION,
    timeout: float = TIMEOUT_OPTION,
):
    """Start a reindex on the server; the service swaps to the new version once it is built and validated."""
    if checksum and not reuse:
        raise UserError("--checksum compares photos for reuse: it goes without --reencode")
    from paraseek.index.cli import index_spec

    index_spec(index_type, params)  # refused here, before any request
    index_params = json.loads(params) if params else {}
    with client(url, token, timeout) as admin:
        job = admin.reindex(source, images=images, bundle=bundle, index_type=index_type, index_params=index_params,
                            reuse=reuse, checksum=checksum, dry_run=dry_run)
        if not wait:
            if as_json:
                print_json(job)
            else:
                console.print(f"job {job['id']} {job['state']}: `paraseek admin job {job['id']} --wait` follows it",
                              highlight=False, soft_wrap=True)
            return
        show(follow(admin, job["id"], poll, wait_timeout), as_json)


@app.command("job")
@user_errors
def job_cmd(
    job_id: str = typer.Argument(..., help="The job's id (`paraseek admin jobs` lists them)."),
    wait: bool = WAIT_OPTION,
    poll: float = POLL_OPTION,
    wait_timeout: Optional[float] = WAIT_TIMEOUT_OPTION,
    as_json: bool = JSON_OPTION,
    url: str = URL_OPTION,
    token: Optional[str] = TOKEN_OPTION,
    timeout: float = TIMEOUT_OPTION,
):
    """Where a job is, or how it ended."""
    with client(url, token, timeout) as admin:
        show(follow(admin, job_id, poll, wait_timeout) if wait else admin.job(job_id), as_json)


@app.command("jobs")
@user_errors
def jobs_cmd(
    state: Optional[List[str]] = typer.Option(None, help="Only jobs in this state (repeatable): queued, running, "
                                              "succeeded, failed, cancelled."),
    as_json: bool = JSON_OPTION,
    url: str = URL_OPTION,
    token: Optional[str] = TOKEN_OPTION,
    timeout: float = TIMEOUT_OPTION,
):
    """The reindex jobs the service remembers, newest first."""
    with client(url, token, timeout) as admin:
        jobs = admin.jobs(state or ())
    if as_json:
        print_json(jobs)
        return
    if not jobs:
        console.print("no jobs" + (f" {' or '.join(state)}" if state else ""), highlight=False)
        return
    for job in jobs:
        console.print(f"{job['id']}  {job['created_at'][:19]}  {job['state']:<9}  {_outcome(job)}", highlight=False,
                      soft_wrap=True, markup=False)


def _outcome(job: dict) -> str:
    """What a job did, or where it is, in a few words."""
    report = job.get("report") or {}
    if job["state"] in ("queued", "running"):
        return _where(job)
    if job["state"] != "succeeded":
        return job.get("error") or ""
    if report.get("dry_run"):
        return "dry run: " + ("nothing changed" if report.get("unchanged") else f"{report.get('encode')} images to encode")
    if report.get("unchanged"):
        return f"nothing changed: {job['snapshot_version']} stays"
    return f"{job['snapshot_version']}: {report.get('indexed')} images ({report.get('encoded')} encoded)"


@app.command("cancel")
@user_errors
def cancel_cmd(
    job_id: str = typer.Argument(..., help="The job's id."),
    wait: bool = typer.Option(False, help="Wait until a running job has stopped (it stops at its next photo or phase)."),
    as_json: bool = JSON_OPTION,
    url: str = URL_OPTION,
    token: Optional[str] = TOKEN_OPTION,
    timeout: float = TIMEOUT_OPTION,
):
    """Cancel a queued or running reindex: the served version stays, the unfinished one is removed."""
    with client(url, token, timeout) as admin:
        job = admin.cancel(job_id)
        if wait and job["state"] not in FINISHED:
            job = follow(admin, job_id, 0.5, None)
    if as_json:
        print_json(job)
    elif job["state"] == "cancelled":
        console.print(f"job {job_id} cancelled; the service still serves its previous version", highlight=False, soft_wrap=True)
    elif job["state"] == "running":
        console.print(f"job {job_id} stops at its next photo or phase (`paraseek admin job {job_id} --wait` follows it)",
                      highlight=False, soft_wrap=True)
    else:  # it ended on its own between the request and the stop
        print_job(job)


@app.command("versions")
@user_errors
def versions_cmd(as_json: bool = JSON_OPTION, url: str = URL_OPTION, token: Optional[str] = TOKEN_OPTION,
                 timeout: float = TIMEOUT_OPTION):
    """The published versions, oldest first: * current, > the one this server serves."""
    with client(url, token, timeout) as admin:
        answer = admin.versions()
    if as_json:
        print_json(answer)
        return
    from paraseek.index.cli import print_version_lines

    rows = answer["versions"]
    marks = {v["version"]: ("*" if v["current"] else " ") + (">" if v["served"] else " ") for v in rows}
    print_version_lines([(marks[v["version"]], v["version"], v["created_at"], v["count"], v["index"], v["recall_at_10"],
                          v["parent"]) for v in rows])
    console.print(f"{answer['backend']} index; * current, > served by {url}", highlight=False, soft_wrap=True)


@app.command("activate")
@user_errors
def activate_cmd(
    version: Optional[str] = typer.Argument(None, help="The version to serve and make current (`paraseek admin versions`)."),
    previous: bool = typer.Option(False, "--previous", help="Roll back: the current version's parent, else the one "
                                  "published before it."),
    as_json: bool = JSON_OPTION,
    url: str = URL_OPTION,
    token: Optional[str] = TOKEN_OPTION,
    timeout: float = TIMEOUT_OPTION,
):
    """Serve a published version and make it current (a rollback with --previous)."""
    if (version is None) == (not previous):
        raise UserError("give a VERSION or --previous (one of the two)")
    with client(url, token, timeout) as admin:
        answer = admin.activate(version, previous=previous)
    if as_json:
        print_json(answer)
    else:
        console.print(f"serving {answer['version']} ({answer['count']} images), was {answer['was']}", highlight=False,
                      soft_wrap=True)


@app.command("reload")
@user_errors
def reload_cmd(
    bundle: str = typer.Argument(..., help="Bundle folder on the server, beside the serving one."),
    precision: Optional[str] = typer.Option(None, help="auto | fp32 | fp16 | int8 (default: auto)."),
    as_json: bool = JSON_OPTION,
    url: str = URL_OPTION,
    token: Optional[str] = TOKEN_OPTION,
    timeout: float = TIMEOUT_OPTION,
):
    """Serve another bundle over the served version (its image space must match)."""
    with client(url, token, timeout) as admin:
        answer = admin.reload(bundle, precision)
    if as_json:
        print_json(answer)
    else:
        console.print(f"serving bundle {answer['bundle']} {answer['version']} ({answer['precision']})", highlight=False,
                      soft_wrap=True)
