"""The FastAPI application: settings, engine and job manager in app.state, routers per resource."""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from contextlib import asynccontextmanager
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.exception_handlers import http_exception_handler
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from fastapi.staticfiles import StaticFiles
from starlette.exceptions import HTTPException as StarletteHTTPException

from paraseek.core import __version__
from paraseek.core.cpu_threads import limit_pthread_blas
from paraseek.core.settings import Settings
from paraseek.core.tokenizer import EmptyTextError
from paraseek.index.filters import FilterError
from paraseek.index.store import IndexUnavailable
from paraseek.service.batcher import Overloaded
from paraseek.service.engine import SearchEngine
from paraseek.service.errors import RequestError
from paraseek.service.jobs import JobManager
from paraseek.service.logging_config import client_address, configure_logging, request_id
from paraseek.service.prometheus import ServiceMetrics
from paraseek.service.routes import admin, embeddings, images, info, page, search

log = logging.getLogger("paraseek.access")


# a body that stops arriving for this long is given up (408): a thousand clients each holding an almost
# complete body cannot hold their connections, and the memory under them, for ever
BODY_READ_TIMEOUT_S = 30.0
UPLOADS_SHARE_OF_IN_FLIGHT = 4  # image uploads (up to PARASEEK_MAX_UPLOAD_BYTES each) at once: max_in_flight / 4
CONNECTIONS_PER_IN_FLIGHT_SLOT = 8  # uvicorn's limit_concurrency, as a multiple of PARASEEK_MAX_IN_FLIGHT


class BodySizeLimit:
    """Pure ASGI middleware: 413 for bodies over the limit, declared or streamed; 408 for a body whose
    next part does not come within ``read_timeout_s``; 503 at once for a request to a ``per_path`` route
    (uploads, whose bodies are held whole) while ``uploads_at_once`` others are being answered."""

    def __init__(self, app, max_bytes: int, per_path: dict[str, int] | None = None,
                 read_timeout_s: float = BODY_READ_TIMEOUT_S, uploads_at_once: int | None = None):
        self.app = app
        self.max_bytes = max_bytes
        self.per_path = per_path or {}  # routes that take more (image uploads)
        self.read_timeout_s = read_timeout_s
        self.uploads_at_once = uploads_at_once
        self.uploads = 0

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope.get("path", "")
        limit = self.per_path.get(path, self.max_bytes)
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            return await self._reject(send, 413)
        if path not in self.per_path or self.uploads_at_once is None:
            return await self._limited(scope, receive, send, limit)
        if self.uploads >= self.uploads_at_once:  # refused before a byte of it is read: upload memory is bounded
            return await self._reject(send, 503)
        self.uploads += 1
        try:
            return await self._limited(scope, receive, send, limit)
        finally:
            self.uploads -= 1

    async def _limited(self, scope, receive, send, limit: int):
        seen = 0
        refusal: int | None = None  # the status that replaces whatever the app answers
        rejected = False

        async def limited_receive():
            nonlocal seen, refusal
            try:
                async with asyncio.timeout(self.read_timeout_s):
                    message = await receive()
            except TimeoutError:
                refusal = 408
                raise _BodyRefused() from None
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > limit:
                    refusal = 413
                    raise _BodyRefused()
            return message

        async def guarded_send(message):
            # FastAPI turns an exception while reading the body into its own 400; once the body is
            # refused, whatever the app answers is replaced by the refusal
            nonlocal rejected
            if refusal is not None:
                if not rejected:
                    rejected = True
                    await self._reject(send, refusal)
                return
            await send(message)

        try:
            await self.app(scope, limited_receive, guarded_send)
        except _BodyRefused:
            if not rejected:
                await self._reject(send, refusal or 413)

    async def _reject(self, send, status: int):
        detail = {413: ("request body too large", "too_large"),
                  408: (f"the request body stopped arriving (nothing for {self.read_timeout_s:g} s)", "body_timeout"),
                  503: (f"{self.uploads_at_once} uploads are being answered, retry shortly", "overloaded")}
        msg, kind = detail[status]
        body = json.dumps({"detail": [{"loc": ["body"], "msg": msg, "type": kind}]}).encode()
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
        if status in (408, 503):  # the rest of the body is not read: the connection cannot carry another request
            headers.append((b"connection", b"close"))
        if status == 503:
            headers.append((b"retry-after", b"1"))
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": body})


class _BodyRefused(Exception):
    pass


# every answer: a browser takes the declared type as it is, never sniffing a JSON error or an image as a page
ANSWER_HEADERS = [(b"x-content-type-options", b"nosniff")]


class ObserveRequests:
    """Pure ASGI middleware: request id (``x-request-id`` in and out, with ``ANSWER_HEADERS``), Prometheus
    counts and latency per route, one access-log line. Outermost, so a 413 of ``BodySizeLimit`` is
    counted as the 413 it is. Pure ASGI because Starlette's ``@app.middleware("http")`` wraps
    every request in extra tasks and streams, which cost more than the encoder call at low load."""

    def __init__(self, app, metrics: ServiceMetrics):
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        given = dict(scope.get("headers") or []).get(b"x-request-id")
        rid = given.decode("latin-1") if given else uuid.uuid4().hex
        token = request_id.set(rid)
        client = scope.get("client")
        address = client_address.set(client[0] if client else None)
        start = time.perf_counter()
        status = 500

        async def send_with_id(message):
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                message = {**message, "headers": [*message.get("headers", []), *ANSWER_HEADERS,
                                                  (b"x-request-id", rid.encode("latin-1"))]}
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        finally:
            path = getattr(scope.get("route"), "path", "unmatched")
            elapsed = time.perf_counter() - start
            self.metrics.requests.labels(path, scope["method"], str(status)).inc()
            self.metrics.latency.labels(path).observe(elapsed)
            if path not in ("/metrics", "/healthz", "/readyz"):
                log.info("request", extra={"route": path, "method": scope["method"], "status": status,
                                           "ms": round(elapsed * 1000, 2)})
            request_id.reset(token)
            client_address.reset(address)


def _error(status: int, loc: list, msg: str, kind: str) -> JSONResponse:
    return JSONResponse({"detail": [{"loc": loc, "msg": msg, "type": kind}]}, status_code=status)


def create_app(settings: Settings | None = None, first_answer_pending: Path | None = None) -> FastAPI:
    """``first_answer_pending``: a first-answer bundle built beside the server (``SearchEngine``)."""
    settings = settings or Settings()
    metrics = ServiceMetrics()
    engine = SearchEngine(settings, metrics, first_answer_pending)
    jobs = JobManager(engine, store=settings.jobs_path)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        await engine.start()
        yield
        jobs.shutdown()
        await engine.stop()

    app = FastAPI(title="paraseek", version=__version__, lifespan=lifespan,
                  description="Text-to-image search whose answers stay the same when a user rephrases the query.")
    app.state.settings, app.state.engine, app.state.jobs = settings, engine, jobs
    for router in (search.router, embeddings.router, images.router, info.router, admin.router, page.router):
        app.include_router(router)
    # matched first; what they decline goes on to the routes above
    app.router.routes[:0] = [*search.plain_routes(), *embeddings.plain_routes()]
    app.mount("/static", StaticFiles(directory=page.STATIC_DIR), name="static")

    @app.exception_handler(RequestError)
    async def request_error(_: Request, exc: RequestError):
        # list positions are numbers, as in pydantic's own locations
        parts = [] if exc.field in ("", "body") else [int(p) if p.isdigit() else p for p in exc.field.split(".")]
        loc = ["body", *parts]
        return _error(exc.status, loc, str(exc), "request_error")

    @app.exception_handler(IndexUnavailable)
    async def index_unavailable(_: Request, exc: IndexUnavailable):
        # the backend's address and error go to the log; clients learn what failed and to retry
        logging.getLogger(__name__).warning("index backend unavailable: %s", exc)
        response = _error(503, ["index"], f"the vector index ({settings.index_backend}) is unavailable; retry shortly",
                          "index_unavailable")
        response.headers["Retry-After"] = "5"
        return response

    @app.exception_handler(FilterError)
    async def filter_error(_: Request, exc: FilterError):
        # a filter the index refuses only when it runs (a Milvus server without infix LIKE)
        return _error(422, ["body", *exc.field.split(".")], str(exc), "filter_error")

    @app.exception_handler(Overloaded)
    async def overloaded(_: Request, exc: Overloaded):
        # refused at once, before any work: the accepted requests keep their latency
        response = _error(503, ["service"], f"overloaded, retry shortly: {exc}", "overloaded")
        response.headers["Retry-After"] = "1"
        return response

    @app.exception_handler(EmptyTextError)
    async def empty_text(_: Request, exc: EmptyTextError):
        return _error(422, ["body", "query"], str(exc), "value_error")

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException):
        # FastAPI answers a body it cannot parse (JSON nested past the parser's depth, broken
        # encodings) with a bare 400; name the body like every other validation error
        if exc.status_code == 400 and str(exc.detail).startswith("There was an error parsing the body"):
            return _error(400, ["body"], "the request body could not be parsed as JSON (malformed or nested too deeply)",
                          "body_invalid")
        return await http_exception_handler(request, exc)

    @app.exception_handler(RequestValidationError)
    async def validation_error(_: Request, exc: RequestValidationError):
        errors = [{"loc": list(e["loc"]), "msg": e["msg"], "type": e["type"]} for e in exc.errors()]
        return JSONResponse({"detail": errors}, status_code=422)

    app.add_middleware(BodySizeLimit, max_bytes=settings.max_body_bytes,
                       per_path={"/v1/search/image": settings.max_upload_bytes},
                       uploads_at_once=max(1, settings.max_in_flight // UPLOADS_SHARE_OF_IN_FLIGHT))
    app.add_middleware(ObserveRequests, metrics=metrics)  # the last added is the outermost
    return app


def run(host: str = "127.0.0.1", port: int = 8000, settings: Settings | None = None,
        first_answer_pending: Path | None = None) -> None:
    """One process: the encoder uses every core for each batch, so more workers would contend."""
    import uvicorn

    settings = settings or Settings()
    configure_logging(settings.log_json)
    limit_pthread_blas()  # this process's parallelism is the encoder's and faiss' threads
    # connections past this are answered 503 by uvicorn itself: room for the requests the engine admits and
    # their keep-alive peers, not for thousands of sockets each holding a request's buffers
    uvicorn.run(create_app(settings, first_answer_pending), host=host, port=port, log_config=None, access_log=False,
                limit_concurrency=CONNECTIONS_PER_IN_FLIGHT_SLOT * settings.max_in_flight)
