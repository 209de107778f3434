from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Annotated

from fastapi import APIRouter, Depends, HTTPException, Query
from fastapi.concurrency import run_in_threadpool

from paraseek.core.bundle import BundleError
from paraseek.core.settings import Settings
from paraseek.index.image_sources import ImageSourceError, resolve_within, source_paths
from paraseek.service.deps import get_engine, get_jobs, get_settings, require_admin
from paraseek.service.engine import SearchEngine
from paraseek.service.errors import RequestError, StaleSwap
from paraseek.service.jobs import JobFinished, JobManager
from paraseek.service.runtime import Active, first_answer_for, load_encoder
from paraseek.service.schemas import (
    ActivateRequest,
    ActivateResponse,
    Job,
    JobsQuery,
    PublishedVersion,
    ReindexRequest,
    ReloadRequest,
    VersionsResponse,
    error_responses,
)

router = APIRouter(prefix="/v1/admin", tags=["admin"], dependencies=[Depends(require_admin)])


def allowed_roots(kind: str, settings: Settings, engine: SearchEngine) -> list[Path]:
    """Where admin requests may read from. ``PARASEEK_REINDEX_ROOT`` when set; else image sources
    only under the serving snapshot's own source folder, and bundles only beside the serving bundle."""
    if settings.reindex_root is not None:
        return [settings.reindex_root]
    if kind == "bundle":
        return [settings.bundle_dir.parent]
    active = engine.active
    root = active.snapshot.manifest.source.get("root") if active is not None else None
    return [Path(root)] if root else []


def check_path(value: str | Path, field: str, roots: list[Path]) -> Path:
    """``value`` resolved (symlinks followed), which is what the caller then uses: 403 for anything
    outside the roots, the same answer whether it exists or not; 422 for a missing path inside them.
    Messages never echo server paths."""
    resolved = resolve_within(value, roots)  # None also for NUL bytes and link loops: never a 500
    if resolved is None:
        raise RequestError(field, f"{field} is not under an allowed root (PARASEEK_REINDEX_ROOT)", status=403)
    if not resolved.exists():
        raise RequestError(field, f"{field} does not exist under the allowed root")
    return resolved


def check_source(value: str, roots: list[Path]) -> str:
    """The source to read: a path resolved once, or a shard pattern whose every member was checked
    (the job checks each again when it opens them, so a link swapped in between is refused too)."""
    try:
        members = source_paths(value)
    except ImageSourceError as exc:  # a pattern naming too many shards
        raise RequestError("source", str(exc)) from None
    if len(members) == 1 and str(members[0]) == value:
        return str(check_path(value, "source", roots))
    for member in members:
        check_path(member, "source", roots)
    return value


@router.post("/reindex", response_model=Job, status_code=202, responses=error_responses(400, 401, 403, 404, 413, 422, 503))
async def reindex(req: ReindexRequest, jobs: JobManager = Depends(get_jobs), settings: Settings = Depends(get_settings),
                  engine: SearchEngine = Depends(get_engine)):
    """Start a background build; the service swaps to it once it is built and validated."""
    sources = allowed_roots("source", settings, engine)
    bundles = allowed_roots("bundle", settings, engine)

    def checked_paths() -> dict[str, str]:  # a file system call per shard of a pattern: off the event loop
        checked = {"source": check_source(req.source, sources)}
        if req.images:
            checked["images"] = str(check_path(req.images, "images", sources))
        if req.bundle:
            checked["bundle"] = str(check_path(req.bundle, "bundle", bundles))
        return checked

    checked = await run_in_threadpool(checked_paths)
    return jobs.submit_reindex(req.model_copy(update=checked), within=sources)


@router.get("/jobs", response_model=list[Job], responses=error_responses(401, 403, 422))
async def jobs_list(query: Annotated[JobsQuery, Query()], jobs: JobManager = Depends(get_jobs)):
    """The reindex jobs this service remembers, newest first (the job to follow or cancel, and what ran)."""
    return jobs.listed(query.state)


@router.get("/jobs/{job_id}", response_model=Job, responses=error_responses(401, 403, 404))
async def job(job_id: str, jobs: JobManager = Depends(get_jobs)):
    found = jobs.get(job_id)
    if found is None:
        raise HTTPException(404, f"no job {job_id}")
    return found


@router.post("/jobs/{job_id}/cancel", response_model=Job, status_code=202, responses=error_responses(401, 403, 404, 409))
async def cancel_job(job_id: str, jobs: JobManager = Depends(get_jobs)):
    """Cancel a queued or running reindex: a queued one never starts; a running one stops at its next
    photo or phase, its unfinished version removed, and the served version stays. 409 once it has ended."""
    try:
        found = jobs.cancel(job_id)
    except JobFinished as exc:
        raise HTTPException(409, str(exc)) from exc
    if found is None:
        raise HTTPException(404, f"no job {job_id}")
    return found


@router.post("/reload", responses=error_responses(400, 401, 403, 404, 409, 413, 422, 503))
async def reload(req: ReloadRequest, engine: SearchEngine = Depends(get_engine), settings: Settings = Depends(get_settings)):
    """Serve another bundle over the same snapshot (its image_space must match)."""
    bundle = check_path(req.bundle, "bundle", allowed_roots("bundle", settings, engine))
    active = engine.require_active()
    try:
        encoder = await asyncio.to_thread(load_encoder, bundle, settings, req.precision)
    except BundleError as exc:
        raise RequestError("bundle", str(exc)) from exc
    if encoder.image_space != active.snapshot.manifest.image_space:
        raise RequestError(
            "bundle", f"bundle image_space {encoder.image_space!r} does not match the snapshot's "
            f"{active.snapshot.manifest.image_space!r}: reindex with this bundle instead", status=409)
    try:
        await asyncio.to_thread(engine.swap, Active(encoder, active.snapshot, first_answer_for(active, encoder)), active)
    except StaleSwap as exc:
        raise RequestError("bundle", str(exc), status=409) from exc
    return {"bundle": encoder.name, "version": encoder.version, "precision": encoder.precision}


@router.post("/activate", response_model=ActivateResponse, responses=error_responses(400, 401, 403, 404, 409, 413, 422, 503))
async def activate(req: ActivateRequest, engine: SearchEngine = Depends(get_engine)):
    """Serve a published version of the index and make it current: a rollback (``"previous": true``) or any
    version by name (``paraseek index versions`` lists them). Replicas that poll follow the new current."""
    try:
        manifest, was = await asyncio.to_thread(engine.serve_version, None if req.previous else req.version)
    except StaleSwap as exc:
        raise RequestError("version", str(exc), status=409) from exc
    return ActivateResponse(version=manifest.version, was=was, count=manifest.count, created_at=manifest.created_at)


@router.get("/versions", response_model=VersionsResponse, responses=error_responses(401, 403, 503))
async def versions(engine: SearchEngine = Depends(get_engine)):
    """The published versions of the index, oldest first: which one is current and which one this server
    serves (what ``POST /v1/admin/activate`` can make current; ``paraseek index versions`` from a shell)."""
    manifests, current, served = await asyncio.to_thread(engine.published_versions)
    return VersionsResponse(backend=engine.require_active().snapshot.manifest.backend, versions=[
        PublishedVersion(version=m.version, created_at=m.created_at, parent=m.parent, count=m.count, image_space=m.image_space,
                         index=m.index.type, recall_at_10=m.recall_at_10, current=m.version == current, served=m.version == served)
        for m in manifests])
