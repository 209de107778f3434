"""OpenAI-compatible embeddings, so users can embed texts with the served text tower from their own tools."""

from __future__ import annotations

import orjson
from fastapi import APIRouter, Depends, Response

from paraseek.service.deps import engine_of, get_engine
from paraseek.service.engine import SearchEngine
from paraseek.service.plain_route import PlainJsonRoute
from paraseek.service.schemas import EmbeddingsRequest, EmbeddingsResponse, error_responses

router = APIRouter(prefix="/v1", tags=["embeddings"])


@router.post("/embeddings", response_model=EmbeddingsResponse, responses=error_responses(400, 404, 413, 422, 503))
async def embeddings(req: EmbeddingsRequest, engine: SearchEngine = Depends(get_engine)):
    """OpenAI's ``POST /v1/embeddings``: ``input`` a text or a list, ``model`` a name ``GET /v1/models``
    lists, ``encoding_format`` float or base64. Shares the search path's cache and micro-batcher."""
    return Response(orjson.dumps(await engine.embeddings(req)), media_type="application/json")


def plain_routes() -> list[PlainJsonRoute]:
    """``POST /v1/embeddings`` answered in front of FastAPI (``service.plain_route``), like text search: the
    route of tools that embed many texts."""
    return [PlainJsonRoute.in_front_of(router, embeddings, EmbeddingsRequest,
                                       lambda app, req: engine_of(app).embeddings(req))]


@router.get("/models", responses=error_responses(503))
async def models(engine: SearchEngine = Depends(get_engine)) -> dict:
    """OpenAI's model list: the served bundle, then the first-answer bundle where the server has one
    (``role`` says which; both embed texts)."""
    active = engine.require_active()
    roles = ["served", "first_answer"]
    return {"object": "list", "data": [{"id": e.name, "object": "model", "created": 0, "owned_by": "paraseek",
                                        "version": e.version, "dimensions": e.dim, "role": role}
                                       for e, role in zip(active.text_towers, roles)]}
