"""service.plain_route: a JSON route answered in front of its FastAPI route, which answers whatever the
plain route declines exactly as it would alone."""

from __future__ import annotations

import pytest
from fastapi import APIRouter, FastAPI
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from fastapi.testclient import TestClient
from pydantic import BaseModel, ConfigDict, StrictInt

from paraseek.core.settings import Settings
from paraseek.service.main import create_app
from paraseek.service.plain_route import PlainJsonRoute


pytestmark = pytest.mark.quick


class Item(BaseModel):
    model_config = ConfigDict(extra="forbid")
    q: str
    k: StrictInt = 10


class Refused(Exception):
    pass


def toy_app(plain: bool) -> FastAPI:
    app = FastAPI()
    router = APIRouter(prefix="/v1")

    @router.post("/find")
    async def find(item: Item):
        return {"via": "fastapi", **item.model_dump()}

    app.include_router(router)
    seen_routes: list[str] = []

    @app.middleware("http")
    async def route_name(request, call_next):  # what access logs and metrics read
        response = await call_next(request)
        seen_routes.append(getattr(request.scope.get("route"), "path", "unmatched"))
        return response

    @app.exception_handler(RequestValidationError)
    async def invalid(_, exc: RequestValidationError):  # as the service's: without the input, which may be NaN
        return JSONResponse({"detail": [{"loc": list(e["loc"]), "msg": e["msg"]} for e in exc.errors()]}, status_code=422)

    @app.exception_handler(Refused)
    async def refused(_, exc: Refused):
        return JSONResponse({"refused": str(exc)}, status_code=409)

    async def answer(app_: FastAPI, item: Item) -> dict:
        assert app_ is app
        if item.q == "refuse":
            raise Refused("by the handler")
        return {"via": "plain", **item.model_dump()}

    if plain:
        app.router.routes[:0] = [PlainJsonRoute.in_front_of(router, find, Item, answer)]
    app.state.seen_routes = seen_routes
    return app


def test_a_valid_body_is_answered_by_the_plain_route_with_the_same_fields():
    plain, fastapi = TestClient(toy_app(True)), TestClient(toy_app(False))
    for headers in ({}, {"content-type": "application/json; charset=utf-8"}):
        r = plain.post("/v1/find", json={"q": "dogs", "k": 3}, headers=headers)
        assert r.status_code == 200 and r.json() == {"via": "plain", "q": "dogs", "k": 3}
        assert r.headers["content-type"] == "application/json"
        assert int(r.headers["content-length"]) == len(r.content)
    assert fastapi.post("/v1/find", json={"q": "dogs", "k": 3}).json() == {"via": "fastapi", "q": "dogs", "k": 3}
    # a body sent in several chunks is read whole
    r = plain.post("/v1/find", content=iter([b'{"q": "do', b'gs"}']), headers={"content-type": "application/json"})
    assert r.json() == {"via": "plain", "q": "dogs", "k": 10}
    assert plain.app.state.seen_routes[-1] == "/v1/find"  # named as the FastAPI route


@pytest.mark.parametrize("body, content_type", [
    (b'{"q": "dogs", "k": 3', "application/json"),  # broken JSON
    (b"", "application/json"),
    (b'{"q": "dogs", "k": NaN}', "application/json"),  # json.loads takes NaN, orjson does not
    (b'{"q": "dogs", "k": "3"}', "application/json"),  # refused by the model
    (b'{"q": "dogs", "extra": 1}', "application/json"),
    (b'{"k": 3}', "application/json"),
    (b'\xef\xbb\xbf{"q": "dogs"}', "application/json"),  # a UTF-8 byte-order mark
    (b'{"q": "\\ud800"}', "application/json"),  # a lone surrogate
    (b'{"q": "dogs"}', "text/plain"),
    (b'{"q": "dogs"}', "application/vnd.api+json"),
    (b'{"q": "dogs"}', None),
    (b"[1, 2]", "application/json"),
])
def test_what_the_plain_route_declines_gets_the_fastapi_routes_answer(body, content_type):
    headers = {"content-type": content_type} if content_type else {}
    # a lone surrogate passes the toy model and fails the response's encoding: a 500 either way
    plain, fastapi = (TestClient(toy_app(p), raise_server_exceptions=False) for p in (True, False))
    got, want = plain.post("/v1/find", content=body, headers=headers), fastapi.post("/v1/find", content=body, headers=headers)
    assert (got.status_code, got.content) == (want.status_code, want.content)
    if want.status_code == 200:
        assert got.json()["via"] == "fastapi"


def test_handler_exceptions_reach_the_apps_exception_handlers_and_other_methods_the_fastapi_route():
    plain, fastapi = TestClient(toy_app(True)), TestClient(toy_app(False))
    r = plain.post("/v1/find", json={"q": "refuse"})
    assert r.status_code == 409 and r.json() == {"refused": "by the handler"}
    for method in ("GET", "PUT"):
        got, want = plain.request(method, "/v1/find"), fastapi.request(method, "/v1/find")
        assert (got.status_code, got.content, got.headers.get("allow")) == \
            (want.status_code, want.content, want.headers.get("allow"))


@pytest.mark.parametrize("path, body", [
    ("/v1/search", {"query": "a dog on a beach", "k": 5}),  # valid: the engine, not started, answers 503
    ("/v1/search", {"query": "a dog", "k": 0}),
    ("/v1/search", {"query": "   "}),
    ("/v1/search", {"query": "a dog", "unknown": 1}),
    ("/v1/search", {"query": "a dog", "expansion": {"method": "nope"}}),
    ("/v1/search", {}),
    ("/v1/embeddings", {"input": ["a dog", "a cat"], "model": "paraseek-starter"}),
    ("/v1/embeddings", {"input": [], "model": "paraseek-starter"}),
    ("/v1/embeddings", {"input": "a dog", "model": "paraseek-starter", "encoding_format": "hex"}),
    ("/v1/embeddings", {"model": "paraseek-starter"}),
])
def test_the_services_plain_routes_answer_as_their_fastapi_routes_do(path, body):
    with_plain = create_app(Settings())
    without = create_app(Settings())
    without.router.routes[:] = [r for r in without.router.routes if not isinstance(r, PlainJsonRoute)]
    assert any(isinstance(r, PlainJsonRoute) and r.path == path for r in with_plain.router.routes)
    got, want = TestClient(with_plain).post(path, json=body), TestClient(without).post(path, json=body)
    assert got.status_code == want.status_code and got.status_code in (422, 503)
    assert got.json() == want.json()
