from __future__ import annotations

import asyncio
from pathlib import Path

from fastapi import APIRouter, Depends, HTTPException

from core.bundle import BundleError
from core.settings import Settings
from service.deps import get_engine, get_jobs, get_settings, require_admin
from service.engine import Active, RequestError, SearchEngine, load_encoder
from service.jobs import JobManager
from service.schemas import Job, ReindexRequest, ReloadRequest

router = APIRouter(prefix="/v1/admin", tags=["admin"], dependencies=[Depends(require_admin)])


def _allowed(path: str, field: str, settings: Settings) -> None:
    if settings.reindex_root is not None:
        root = Path(settings.reindex_root).resolve()
        if not Path(path).resolve().is_relative_to(root):
            raise RequestError(field, f"{field} must be under {root}", status=403)
    if not Path(path).exists():
        raise RequestError(field, f"{path} does not exist on the server")


@router.post("/reindex", response_model=Job, status_code=202)
async def reindex(req: ReindexRequest, jobs: JobManager = Depends(get_jobs), settings: Settings = Depends(get_settings)):
    """Start a background build; the service swaps to it once it is built and validated."""
    _allowed(req.source, "source", settings)
    if req.images:
        _allowed(req.images, "images", settings)
    if req.bundle:
        _allowed(req.bundle, "bundle", settings)
    return jobs.submit_reindex(req)


@router.get("/jobs/{job_id}", response_model=Job)
async def job(job_id: str, jobs: JobManager = Depends(get_jobs)):
    found = jobs.get(job_id)
    if found is None:
        raise HTTPException(404, f"no job {job_id}")
    return found


@router.post("/reload")
async def reload(req: ReloadRequest, engine: SearchEngine = Depends(get_engine), settings: Settings = Depends(get_settings)):
    """Serve another bundle over the same snapshot (its image_space must match)."""
    _allowed(req.bundle, "bundle", settings)
    active = engine.require_active()
    try:
        encoder = await asyncio.to_thread(load_encoder, req.bundle, settings, req.precision)
    except BundleError as exc:
        raise RequestError("bundle", str(exc)) from exc
    if encoder.image_space != active.snapshot.manifest.image_space:
        raise RequestError(
            "bundle", f"bundle image_space {encoder.image_space!r} does not match the snapshot's "
            f"{active.snapshot.manifest.image_space!r}: reindex with this bundle instead", status=409)
    engine.swap(Active(encoder, active.snapshot))
    return {"bundle": encoder.name, "version": encoder.version, "precision": encoder.precision}
