"""The service's own ASGI layers (``service.main``): body limits in size and in pace."""

import pytest
from fastapi.testclient import TestClient
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from paraseek.service.main import BodySizeLimit

pytestmark = pytest.mark.quick


async def echo_size(request: Request):
    return JSONResponse({"bytes": len(await request.body())})


def limited(**kwargs):
    return TestClient(BodySizeLimit(Starlette(routes=[Route("/", echo_size, methods=["POST"])]), **kwargs))


def calls(app, *bodies: list[tuple[float, bytes]]) -> list[list[dict]]:
    """What ``app`` sends for POSTs made at once whose body parts arrive after the given pauses (as a
    server's receive hands them over: TestClient would read each whole body first)."""
    import asyncio

    async def one(parts):
        sent: list[dict] = []
        queue = list(parts)

        async def receive():
            if not queue:
                await asyncio.sleep(3600)  # the client went quiet
            pause, body = queue.pop(0)
            await asyncio.sleep(pause)
            return {"type": "http.request", "body": body, "more_body": bool(queue)}

        async def send(message):
            sent.append(message)

        scope = {"type": "http", "method": "POST", "path": "/", "headers": [], "query_string": b"", "root_path": ""}
        await asyncio.wait_for(app(scope, receive, send), 10)
        return sent

    async def run():
        return await asyncio.gather(*(one(parts) for parts in bodies))

    return asyncio.run(run())


def call(app, parts: list[tuple[float, bytes]]) -> list[dict]:
    return calls(app, parts)[0]


def test_a_body_that_stops_arriving_is_given_up_with_408():
    app = BodySizeLimit(Starlette(routes=[Route("/", echo_size, methods=["POST"])]), max_bytes=1 << 20, read_timeout_s=0.3)
    slow = call(app, [(0, b"x" * 1000), (1.0, b"y" * 1000)])
    assert slow[0]["status"] == 408 and (b"connection", b"close") in slow[0]["headers"]
    assert b"body_timeout" in slow[1]["body"]
    steady = call(app, [(0, b"x" * 1000), (0.1, b"y" * 1000), (0.1, b"z")])  # parts that keep coming are read whole
    assert steady[0]["status"] == 200 and steady[1]["body"] == b'{"bytes":2001}'


def test_a_body_over_the_limit_is_413_declared_or_streamed():
    with limited(max_bytes=1500) as c:
        assert c.post("/", content=b"x" * 2000).status_code == 413
        streamed = c.post("/", content=iter([b"x" * 1000, b"x" * 1000]))
        assert streamed.status_code == 413 and streamed.json()["detail"][0]["type"] == "too_large"
        assert c.post("/", content=b"x" * 1500).json() == {"bytes": 1500}


def test_uploads_past_their_share_are_refused_before_their_bodies_are_read():
    inner = Starlette(routes=[Route("/", echo_size, methods=["POST"])])
    app = BodySizeLimit(inner, max_bytes=1000, per_path={"/": 1 << 20}, uploads_at_once=1)
    slow, refused = calls(app, [(0, b"x" * 5000), (0.5, b"y")], [(0.1, b"z" * 5000)])
    assert slow[0]["status"] == 200 and slow[1]["body"] == b'{"bytes":5001}'
    assert refused[0]["status"] == 503 and (b"retry-after", b"1") in refused[0]["headers"]
    assert app.uploads == 0 and call(app, [(0, b"z")])[0]["status"] == 200  # the slot is free again
