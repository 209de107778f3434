from __future__ import annotations

import asyncio
import base64
import binascii

import orjson
from fastapi import APIRouter, Depends, Request, Response
from pydantic import ValidationError
from starlette.datastructures import UploadFile

from paraseek.core.settings import Settings
from paraseek.service.deps import engine_of, get_engine, get_settings
from paraseek.service.engine import SearchEngine
from paraseek.service.errors import RequestError
from paraseek.service.plain_route import PlainJsonRoute
from paraseek.service.schemas import (
    BatchSearchRequest,
    BatchSearchResponse,
    ImageSearchRequest,
    SearchRequest,
    SearchResponse,
    SimilarSearchRequest,
    error_responses,
)

router = APIRouter(prefix="/v1", tags=["search"])


def _json(body) -> Response:
    return Response(orjson.dumps(body), media_type="application/json")


# The engine builds the body from SearchResponse already; returning it as a Response skips FastAPI's
# second validation pass (response_model stays for the OpenAPI schema).
@router.post("/search", response_model=SearchResponse, response_model_exclude_none=True,
             responses=error_responses(400, 408, 413, 422, 429, 502, 503))
async def search(req: SearchRequest, engine: SearchEngine = Depends(get_engine)):
    """Text-to-image search, with optional query expansion, consistency report and weighted terms."""
    return _json(await engine.search(req))


def plain_routes() -> list[PlainJsonRoute]:
    """The routes of this module answered in front of FastAPI (``service.plain_route``): text search, the
    route the service's load is made of."""
    return [PlainJsonRoute.in_front_of(router, search, SearchRequest, lambda app, req: engine_of(app).search(req))]


BATCH_SHARE_OF_IN_FLIGHT = 4  # a batch's searches run at most max_in_flight / 4 at once


@router.post("/search/batch", response_model=BatchSearchResponse, response_model_exclude_none=True,
             responses=error_responses(400, 408, 413, 422, 429, 502, 503))
async def search_batch(
    req: BatchSearchRequest, engine: SearchEngine = Depends(get_engine), settings: Settings = Depends(get_settings)
):
    """Many searches in one call; their texts share encoder batches."""
    if len(req.requests) > settings.max_batch_queries:
        raise RequestError("requests", f"at most {settings.max_batch_queries} requests per batch")
    # at most a share of the in-flight slots at once: one client's batch never sheds the other clients' requests
    slots = asyncio.Semaphore(max(1, settings.max_in_flight // BATCH_SHARE_OF_IN_FLIGHT))

    async def one(r: SearchRequest):
        async with slots:
            return await engine.search(r)

    results = await asyncio.gather(*(one(r) for r in req.requests), return_exceptions=True)
    for i, r in enumerate(results):
        if isinstance(r, RequestError):
            raise RequestError(f"requests.{i}.{r.field}", str(r), r.status)
        if isinstance(r, BaseException):
            raise r
    return _json({"responses": results})


_IMAGE_BODY = {
    "requestBody": {"required": True, "content": {
        "multipart/form-data": {"schema": {"type": "object", "required": ["image"], "properties": {
            "image": {"type": "string", "format": "binary", "description": "the image file"},
            "k": {"type": "integer", "default": 10, "minimum": 1, "maximum": 1000},
            "offset": {"type": "integer", "default": 0, "minimum": 0, "maximum": 999},
            "filter": {"type": "string", "description": "a search filter as JSON text"}}}},
        "application/json": {"schema": ImageSearchRequest.model_json_schema()},
    }}
}


@router.post("/search/image", response_model=SearchResponse, response_model_exclude_none=True, openapi_extra=_IMAGE_BODY,
             responses=error_responses(400, 408, 413, 415, 422, 503))
async def search_image(request: Request, engine: SearchEngine = Depends(get_engine)):
    """Image-to-image search with the bundle's image tower: a multipart upload (field ``image``, plus
    ``k``/``offset`` form fields) or JSON with the file base64-encoded."""
    content_type = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if content_type == "multipart/form-data":
        form = await request.form(max_files=1, max_fields=8)
        single = {name: _form_field(form, name) for name in ("image", "k", "offset", "filter")}
        upload = single["image"]
        if not isinstance(upload, UploadFile):
            raise RequestError("image", "send the image file in the multipart field 'image'")
        data = await upload.read()
        values: dict = {"image": "-", **{n: _form_int(n, single[n]) for n in ("k", "offset") if single[n] is not None}}
        if single["filter"] is not None:  # a form field carries the filter as JSON text
            try:
                values["filter"] = orjson.loads(str(single["filter"]))
            except orjson.JSONDecodeError as exc:
                raise RequestError("filter", f"the filter form field is not valid JSON: {exc}") from exc
        params = _validated(ImageSearchRequest, values)
    elif content_type == "application/json":
        try:
            body = orjson.loads(await request.body())
        except orjson.JSONDecodeError as exc:
            raise RequestError("body", f"the request body is not valid JSON: {exc}", status=400) from exc
        params = _validated(ImageSearchRequest, body)
        data = _base64_image(params.image)
    else:
        raise RequestError("body", "send the image as multipart/form-data (field 'image') or as JSON with base64 'image'",
                           status=415)
    return _json(await engine.search_image(data, params.k, params.offset, flt=params.filter))


@router.post("/search/similar", response_model=SearchResponse, response_model_exclude_none=True,
             responses=error_responses(400, 404, 413, 422, 503))
async def search_similar(req: SimilarSearchRequest, engine: SearchEngine = Depends(get_engine)):
    """"More like this": the images nearest to an indexed image (itself left out unless asked)."""
    return _json(await engine.search_similar(req.id, req.k, req.offset, req.include_self, req.filter))


def _form_field(form, name: str):
    """A form field's one value: a field sent twice is ambiguous (which k?), so it is refused."""
    values = form.getlist(name)
    if len(values) > 1:
        raise RequestError(name, f"{name} is sent {len(values)} times; send it once")
    return values[0] if values else None


def _form_int(name: str, value) -> int:
    try:
        return int(str(value))
    except ValueError:
        raise RequestError(name, f"{name} must be an integer, not {str(value)[:40]!r}") from None


def _validated(model, body):
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        first = exc.errors()[0]
        raise RequestError(".".join(str(x) for x in first["loc"]) or "body", first["msg"]) from exc


def _base64_image(text: str) -> bytes:
    if text.startswith("data:"):  # a data URL, as a browser's FileReader makes it
        _, _, text = text.partition(",")
    try:
        return base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise RequestError("image", f"is not valid base64: {exc}") from exc
