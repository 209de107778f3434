"""Service fixtures: the demo snapshot, in-process apps, a real uvicorn, a real redis-server and a
fake OpenAI-compatible endpoint, all on loopback."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from paraseek.loadtests.net import free_port, wait_listening
from tests.conftest import MILVUS_SERVER
from tests.whole_photo_starter import (  # noqa: F401  (fixtures)
    whole_photo_bank,
    whole_photo_bundle,
    whole_photo_encoder,
    whole_photo_robust_bundle,
)
from paraseek.loadtests.server import ServerNotReady, start_server
from paraseek.index.demo import build_demo_snapshot

ADMIN_TOKEN = "s3cret-admin-token"


def assert_error_names(response, loc: list, status: int = 422, whole: bool = False) -> None:
    """``response`` is a ``status`` error whose first detail points at ``loc`` (or below it, unless ``whole``)."""
    assert response.status_code == status, response.text
    got = response.json()["detail"][0]["loc"]
    assert (got if whole else got[: len(loc)]) == loc, got


@pytest.fixture(scope="session")
def demo_snapshot(starter_encoder, tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("demo-snap")
    build_demo_snapshot(starter_encoder, root, progress=False)
    return root


@pytest.fixture()
def snapshot_copy(demo_snapshot, tmp_path) -> Path:
    """A private copy for tests that reindex."""
    dst = tmp_path / "snap"
    shutil.copytree(demo_snapshot, dst)
    return dst


@pytest.fixture()
def make_settings(starter_bundle, demo_snapshot, shared_data, tmp_path, backend, request):
    """Settings of an app under test. On the milvus backend the snapshot named (default: the demo) is
    copied into a collection prefix of the test's own in the session's Milvus Lite, and served from there."""
    from paraseek.core.settings import Settings

    os.environ.setdefault("NLTK_DATA", str(shared_data / "nltk_data"))

    def make(**overrides) -> Settings:
        # fp32: the hand computations the tests compare with run the fp32 tower (``auto`` picks int8 for
        # the starters); tests of int8 serving name it. freeze_heap off: an app started in a test process
        # would collect and freeze the whole session's heap (torch's included), 0.64 s a start (tested on its own)
        base = dict(bundle=starter_bundle, snapshot=demo_snapshot, admin_token=ADMIN_TOKEN, log_json=False,
                    llm_cache=tmp_path / "llm-cache.jsonl", home=tmp_path / "home", precision="fp32", freeze_heap=False)
        base.update(overrides)
        if backend == "milvus" and "index_backend" not in overrides:
            base.update(milvus_settings(request.getfixturevalue("milvus_lite_uri"), Path(base["snapshot"])))
        if backend == MILVUS_SERVER and "index_backend" not in overrides:
            base.update(server_settings(request.getfixturevalue("milvus_standalone").uri, Path(base["snapshot"])))
        return Settings(**base)

    return make


def milvus_env(uri: str, snapshot: Path) -> dict:
    """PARASEEK_* variables of a server that serves a copy of ``snapshot`` from Milvus at ``uri``."""
    settings = milvus_settings(uri, snapshot)
    return {"PARASEEK_INDEX_BACKEND": "milvus", "PARASEEK_MILVUS_URI": uri,
            "PARASEEK_MILVUS_COLLECTION": settings["milvus_collection"]}


def milvus_settings(uri: str, snapshot: Path) -> dict:
    """Settings serving a copy of a FAISS snapshot's current version from a fresh Milvus collection prefix."""
    from paraseek.index.builder import copy_snapshot
    from paraseek.index.milvus_store import MilvusStore
    from paraseek.index.snapshot import FaissStore, Snapshot
    from tests.conftest import fresh_prefix

    prefix = fresh_prefix()
    if FaissStore(snapshot).current_version() is not None:
        store = MilvusStore(uri, prefix=prefix)
        copy_snapshot(Snapshot.load(snapshot), store)
    return {"index_backend": "milvus", "milvus_uri": uri, "milvus_collection": prefix}


_SERVER_COPIES: dict[tuple, dict] = {}


def server_settings(uri: str, snapshot: Path) -> dict:
    """As ``milvus_settings`` on a real server, where writing a version takes about 11 s: one copy of each
    snapshot version per server, shared by the tests that only read it."""
    from paraseek.index.snapshot import FaissStore

    key = (uri, str(snapshot), FaissStore(snapshot).current_version())
    if key not in _SERVER_COPIES:
        _SERVER_COPIES[key] = milvus_settings(uri, snapshot)
    return _SERVER_COPIES[key]


@pytest.fixture()
def client(make_settings):
    from paraseek.service.main import create_app

    with TestClient(create_app(make_settings())) as c:
        yield c


@pytest.fixture()
def redis_server(tmp_path):
    """A real redis-server on loopback; the test may kill it (``proc``) and start it again on the
    same port (``restart()``)."""
    exe = shutil.which("redis-server")
    if exe is None:
        pytest.fail("redis-server is not installed (README install step)")
    port = free_port()
    server: dict = {"url": f"redis://127.0.0.1:{port}/0", "port": port}

    def start():
        proc = subprocess.Popen(
            [exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no", "--dir", str(tmp_path),
             "--enable-debug-command", "local"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        wait_listening(port, 10, process=proc)
        server["proc"] = proc
        return proc

    def restart():
        if server["proc"].poll() is None:
            server["proc"].kill()
            server["proc"].wait()
        return start()

    start()
    server["restart"] = restart
    yield server
    if server["proc"].poll() is None:
        server["proc"].kill()
        server["proc"].wait()


@pytest.fixture()
def uvicorn_server(starter_bundle, shared_data, tmp_path):
    """Start ``paraseek`` over a real uvicorn on loopback with the given PARASEEK_* environment."""
    procs = []

    def start(snapshot: Path, **env) -> str:
        port = free_port()
        server_env = {"PARASEEK_BUNDLE": str(starter_bundle), "PARASEEK_SNAPSHOT": str(snapshot),
                      "PARASEEK_ADMIN_TOKEN": ADMIN_TOKEN, "PARASEEK_LOG_JSON": "true",
                      "NLTK_DATA": str(shared_data / "nltk_data"), "PARASEEK_HOME": str(tmp_path / "home"),
                      "PARASEEK_PRECISION": "fp32",  # as make_settings: what the tests compute by hand
                      **{k: str(v) for k, v in env.items()}}
        try:
            proc, url = start_server(server_env, log=tmp_path / f"server-{port}.log", port=port, timeout=60)
        except ServerNotReady as exc:
            pytest.fail(str(exc))
        procs.append(proc)
        return url

    start.procs = procs  # type: ignore[attr-defined]  # tests that kill a server
    yield start
    for proc in procs:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()


class _FakeChat(BaseHTTPRequestHandler):
    calls: list = []
    answered = 0  # calls answered so far
    fail = False
    # a slow endpoint, under the test's control: calls past the first ``answer_first`` wait until the
    # test sets ``release`` (30 s at most), so a test asserts what happened before they were answered
    release = threading.Event()
    answer_first = 0
    held = False
    lock = threading.Lock()

    @classmethod
    def hold(cls, answer_first: int = 0) -> None:
        cls.held, cls.answer_first = True, answer_first

    def do_POST(self):  # noqa: N802
        body = json.loads(self.rfile.read(int(self.headers["content-length"])))
        with _FakeChat.lock:
            _FakeChat.calls.append({"path": self.path, "body": body, "auth": self.headers.get("authorization")})
            hold = _FakeChat.held and len(_FakeChat.calls) > _FakeChat.answer_first
        if hold:
            _FakeChat.release.wait(30)
        with _FakeChat.lock:
            _FakeChat.answered += 1
        if _FakeChat.fail:
            self.send_response(503)
            self.end_headers()
            return
        prompt = body["messages"][0]["content"]
        text = prompt.rsplit(": ", 1)[-1]
        n = len(_FakeChat.calls)
        if "avoiding" in prompt:
            reply = f"an image that depicts {text.lower()} (variant {n})"
        else:
            reply = f"a picture of {text.lower().rstrip('.')} (version {n})"
        data = json.dumps({"choices": [{"message": {"role": "assistant", "content": reply}}]}).encode()
        try:
            self.send_response(200)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
        except (BrokenPipeError, ConnectionResetError):  # a call its caller gave up on, answered once released
            pass

    def log_message(self, *args):
        pass


@pytest.fixture()
def fake_llm():
    """A fake OpenAI-compatible chat endpoint: ``handler.calls`` it received, ``handler.answered``;
    ``handler.hold(answer_first=0)`` keeps later calls waiting until ``handler.release.set()``."""
    _FakeChat.calls, _FakeChat.answered, _FakeChat.fail, _FakeChat.held = [], 0, False, False
    _FakeChat.release = threading.Event()
    server = ThreadingHTTPServer(("127.0.0.1", 0), _FakeChat)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield {"url": f"http://127.0.0.1:{server.server_address[1]}/v1", "handler": _FakeChat}
    _FakeChat.release.set()  # no call stays waiting on the test that is over
    server.shutdown()
