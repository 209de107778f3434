"""A hot JSON route answered as plain ASGI, in front of its FastAPI route.

FastAPI's request machinery (the route's middleware and exception wrappers, dependency solving, the body
read into a ``Request`` and parsed by ``json``, the response object) cost about 90 us of the event loop's
time per search, a fifth of it; at concurrency 32 on 2 cores the event loop's time between an index call
and the next encoder calls is time both cores wait for it. This
route reads the body, parses it with orjson and validates it with the same pydantic model, and sends
the handler's dict as JSON. Anything else (another content type, a body orjson or the model refuses)
goes on to the FastAPI route with the body replayed, so every error is the one FastAPI gives, and the
FastAPI route keeps the OpenAPI schema. Exceptions of the handler reach the app's exception handlers
as they do from any route."""

from __future__ import annotations

from typing import Any, Awaitable, Callable

import orjson
from pydantic import BaseModel, ValidationError
from starlette.routing import BaseRoute, Match, NoMatchFound
from starlette.types import Message, Receive, Scope, Send

# the key a request declined by the plain route carries when it goes on to the router again
DECLINED = "paraseek.plain_route.declined"
_JSON_TYPES = (b"application/json", b"application/json; charset=utf-8", b"application/json;charset=utf-8")
_HEADERS = [(b"content-type", b"application/json")]


class PlainJsonRoute(BaseRoute):
    """POST ``route.path`` with a JSON body valid for ``model``: ``answer(app, body)`` returns a JSON-ready
    dict, sent as the response. ``route`` is the FastAPI route it stands in front of (named in the scope,
    so access logs and metrics name it)."""

    def __init__(self, route: BaseRoute, model: type[BaseModel],
                 answer: Callable[[Any, BaseModel], Awaitable[dict]]):
        self.route, self.model, self.answer = route, model, answer
        self.path: str = route.path  # type: ignore[attr-defined]
        self.path_format: str = getattr(route, "path_format", self.path)  # FastAPI's telemetry names the route by it

    @classmethod
    def in_front_of(cls, router, endpoint: Callable, model: type[BaseModel],
                    answer: Callable[[Any, BaseModel], Awaitable[dict]]) -> PlainJsonRoute:
        """The plain route for ``router``'s route of ``endpoint``."""
        return cls(next(r for r in router.routes if getattr(r, "endpoint", None) is endpoint), model, answer)

    def matches(self, scope: Scope) -> tuple[Match, Scope]:
        if (scope["type"] == "http" and scope["method"] == "POST" and scope["path"] == self.path
                and DECLINED not in scope):
            return Match.FULL, {"route": self.route, "endpoint": getattr(self.route, "endpoint", None)}
        return Match.NONE, {}

    def url_path_for(self, name: str, /, **path_params: Any):
        raise NoMatchFound(name, path_params)  # the FastAPI route it stands for is the one named

    async def handle(self, scope: Scope, receive: Receive, send: Send) -> None:
        chunks: list[bytes] = []
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client left while sending
                return
            chunks.append(message.get("body", b""))
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        parsed = self._parse(scope, body)
        if parsed is None:
            return await self._decline(scope, body, receive, send)
        out = orjson.dumps(await self.answer(scope["app"], parsed))
        await send({"type": "http.response.start", "status": 200,
                    "headers": [*_HEADERS, (b"content-length", str(len(out)).encode())]})
        await send({"type": "http.response.body", "body": out})

    def _parse(self, scope: Scope, body: bytes) -> BaseModel | None:
        content_type = next((v for k, v in scope["headers"] if k == b"content-type"), None)
        if content_type is None or content_type.lower() not in _JSON_TYPES:
            return None
        try:
            # python-mode validation of orjson's objects, as FastAPI validates json.loads' objects
            return self.model.model_validate(orjson.loads(body))
        except (orjson.JSONDecodeError, ValidationError):
            return None

    async def _decline(self, scope: Scope, body: bytes, receive: Receive, send: Send) -> None:
        """The router again, without this route: the FastAPI route reads the same body."""
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        scope[DECLINED] = True
        await scope["router"](scope, replay, send)
