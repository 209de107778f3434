from __future__ import annotations

from fastapi import APIRouter, Depends, Response
from fastapi.responses import JSONResponse, PlainTextResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from paraseek.paraphrase.expansions import EXPANSIONS, RewriteExpansion
from paraseek.paraphrase.factory import source_configured
from paraseek.service.deps import get_engine
from paraseek.service.engine import SearchEngine
from paraseek.service.schemas import error_responses

router = APIRouter(tags=["info"])


@router.get("/v1/info", responses=error_responses(503))
async def info(engine: SearchEngine = Depends(get_engine)) -> dict:
    """Bundle, snapshot, index type, vector count and recall of what is serving."""
    active = engine.require_active()
    m, e = active.snapshot.manifest, active.encoder
    return {
        "bundle": {"name": e.name, "version": e.version, "image_space": e.image_space, "precision": e.precision,
                   "dim": e.dim, "providers": e.providers},
        # PARASEEK_FIRST_ANSWER_BUNDLE: the tower whose sure first answers a request's lead_margin puts on top
        "first_answer": ({"name": f.name, "version": f.version, "precision": f.precision}
                         if (f := active.first_answer) is not None else None),
        "snapshot": {"version": m.version, "created_at": m.created_at, "count": m.count, "index": m.index.model_dump(),
                     "recall_at_10": m.recall_at_10, "device": active.snapshot.device, "backend": m.backend,
                     "user_fields": active.snapshot.user_fields,
                     # the index's lists are read from the mapped snapshot file (page cache), not held in process memory
                     "memory_mapped": active.snapshot.memory_mapped,
                     # searches scan a quantized copy of a flat collection (PARASEEK_FLAT_SCAN_COPY)
                     "scan_copy_bytes": active.snapshot.scan_copy_bytes,
                     # each image's hubness for hub_weight: ready (a lookup), building or failed (computed per image)
                     "hub_table": engine.expansion_sources.hub_table_state(active)},
        "cache": engine.cache.backend,
        "batching": engine.encoder_batcher.enabled,
        # the registry the request schema validates against; the search page lists these
        "expansions": [
            {"name": m.name, "label": m.label, "kind": m.kind, "fusions": list(m.fusions),
             "configured": not isinstance(m, RewriteExpansion) or source_configured(m.source, engine.settings)}
            for m in EXPANSIONS.values()
        ],
        "default_expansion": engine.default_expansion.model_dump() if engine.default_expansion else None,
    }


@router.get("/healthz")
async def healthz() -> dict:
    """Liveness: the process answers."""
    return {"status": "ok"}


@router.get("/readyz", responses={503: {"description": "not ready: loading, warming up, or the model/index failed to load"}})
async def readyz(engine: SearchEngine = Depends(get_engine)):
    """Readiness means warm: a model and an index are loaded and every preload that serving depends
    on (WordNet for expansion and consistency) has finished."""
    active = engine.active
    if active is None:
        return JSONResponse({"status": "not ready", "error": engine.load_error}, status_code=503)
    if not engine.warm:
        return JSONResponse({"status": "warming up", "error": None}, status_code=503)
    return {"status": "ready", "snapshot": active.snapshot.version}


@router.get("/metrics", response_class=PlainTextResponse,
            responses={200: {"content": {"text/plain": {"schema": {"type": "string"}}}, "description": "Prometheus text format"}})
async def metrics(engine: SearchEngine = Depends(get_engine)) -> Response:
    """Prometheus metrics."""
    return Response(generate_latest(engine.metrics.registry), media_type=CONTENT_TYPE_LATEST)
