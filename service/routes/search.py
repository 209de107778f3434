from __future__ import annotations

import asyncio

import orjson
from fastapi import APIRouter, Depends, Response

from core.settings import Settings
from service.deps import get_engine, get_settings
from service.engine import RequestError, SearchEngine
from service.schemas import BatchSearchRequest, BatchSearchResponse, SearchRequest, SearchResponse, error_responses

router = APIRouter(prefix="/v1", tags=["search"])


def _json(body) -> Response:
    return Response(orjson.dumps(body), media_type="application/json")


# The engine builds the body from SearchResponse already; returning it as a Response skips FastAPI's
# second validation pass (response_model stays for the OpenAPI schema).
@router.post("/search", response_model=SearchResponse, response_model_exclude_none=True,
             responses=error_responses(400, 413, 422, 502, 503))
async def search(req: SearchRequest, engine: SearchEngine = Depends(get_engine)):
    """Text-to-image search, with optional query expansion, consistency report and weighted terms."""
    return _json(await engine.search(req))


@router.post("/search/batch", response_model=BatchSearchResponse, response_model_exclude_none=True,
             responses=error_responses(400, 413, 422, 502, 503))
async def search_batch(
    req: BatchSearchRequest, engine: SearchEngine = Depends(get_engine), settings: Settings = Depends(get_settings)
):
    """Many searches in one call; their texts share encoder batches."""
    if len(req.requests) > settings.max_batch_queries:
        raise RequestError("requests", f"at most {settings.max_batch_queries} requests per batch")
    results = await asyncio.gather(*(engine.search(r) for r in req.requests), return_exceptions=True)
    for i, r in enumerate(results):
        if isinstance(r, RequestError):
            raise RequestError(f"requests.{i}.{r.field}", str(r), r.status)
        if isinstance(r, BaseException):
            raise r
    return _json({"responses": results})
