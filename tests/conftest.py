"""Shared fixtures. Test data comes from ../shared/data (the product itself never reads it)."""

from __future__ import annotations

import os
import sys
import tempfile

# The tests run as `.venv/bin/python -m pytest`: the tools this environment installs (hadolint,
# locust, ...) are found as an activated environment would find them
os.environ["PATH"] = os.pathsep.join([os.path.dirname(sys.executable), os.environ.get("PATH", "")])
# Before anything imports huggingface_hub: a hub lookup here waits ~50 s before failing.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
# pytest-xdist runs several test processes side by side: each takes its share of the cores for
# OpenMP (torch, faiss, BLAS), since OpenMP threads that outnumber the cores spin against each other
if os.environ.get("PYTEST_XDIST_WORKER_COUNT"):
    _share = (os.cpu_count() or 1) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"])
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, _share)))

import json
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import numpy as np
import pytest

pytest_plugins = ["tests.scheduling"]

ROOT = Path(__file__).resolve().parents[1]
SHARED = Path(os.environ.get("PARASEEK_SHARED_DATA", ROOT.parent / "shared" / "data"))
FIXTURES = Path(__file__).resolve().parent / "fixtures"
TINY_CLIP_CONFIG = FIXTURES / "tiny-clip.json"
COCO_VAL_JSON = SHARED / "coco-mini" / "captions_val2017.json"


@pytest.fixture(scope="session")
def shared_data() -> Path:
    if not SHARED.is_dir():
        pytest.fail(f"test data folder {SHARED} is missing (see README: ../shared/data)")
    return SHARED


@pytest.fixture(scope="session")
def coco_val(shared_data):
    data = json.loads(COCO_VAL_JSON.read_text())
    captions = [a["caption"] for a in data["annotations"]]
    image_ids = np.array([a["image_id"] for a in data["annotations"]])
    return data, captions, image_ids


@contextmanager
def _every_core():
    """Every core for OpenMP (torch, onnxruntime) while this process builds what the other test
    processes wait for: they sit idle meanwhile, so its usual share would leave cores unused."""
    import paraseek.training.torch_env  # noqa: F401  (torchvision shim before torch-side imports)
    import torch

    share, threads = os.environ.get("OMP_NUM_THREADS"), torch.get_num_threads()
    os.environ["OMP_NUM_THREADS"] = str(os.cpu_count() or 1)
    torch.set_num_threads(os.cpu_count() or 1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)
        if share is None:
            os.environ.pop("OMP_NUM_THREADS", None)
        else:
            os.environ["OMP_NUM_THREADS"] = share


# A test process keeps what earlier tests left in reference cycles (an app and its engine refer to each
# other, and hold encoder sessions and indexes) until a full collection, which the interpreter seldom
# runs: test processes grew to 5-6 GB each. After a test that left this process's private memory
# COLLECT_AFTER_GROWTH_MB above where the last collection left it, collect and give the freed heap back.
COLLECT_AFTER_GROWTH_MB = 100
_private_after_collection = [0.0]


def pytest_collection_finish(session):
    """What collection imported (torch, every test module: millions of objects) lives as long as the
    process: frozen out of the collector's reach, a full collection walks only what the tests made
    (0.65 s a collection before, in a test process of the whole suite)."""
    import gc

    gc.collect()
    gc.freeze()


@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown(item, nextitem):
    from paraseek.core.memory import process_memory, release_free_memory

    private = process_memory().private_mb
    if private - _private_after_collection[0] > COLLECT_AFTER_GROWTH_MB:  # False where unknown (NaN)
        release_free_memory()
        _private_after_collection[0] = process_memory().private_mb


# -- the quick tier (``pytest -m quick``): tests marked ``quick`` that start no server process (Redis
# aside), export no model and build no starter beyond the cached ones (``built_once``). A module-level
# mark covers the module; in a module run on several index backends, a test's mark covers its FAISS
# variant only. Asking a quick test for one of these fixtures is a collection error, so the tier stays quick.
NOT_QUICK_FIXTURES = frozenset({"tiny_clip", "milvus_standalone", "own_milvus_standalone", "milvus_server", "uvicorn_server",
                                "whole_photo_robust_bundle", "embedded_home"})


@pytest.hookimpl(tryfirst=True)  # before ``-m`` deselects by mark
def pytest_collection_modifyitems(config, items):
    heavy = []
    for item in items:
        if item.get_closest_marker("quick") is None:
            continue
        params = getattr(item, "callspec", None)
        if params is not None and params.params.get("backend", "faiss") != "faiss":
            if not any(m.name == "quick" for m in item.own_markers):
                heavy.append(f"{item.nodeid}: a module-level quick mark in a module run on several backends")
            item.own_markers[:] = [m for m in item.own_markers if m.name != "quick"]
            continue
        uses = NOT_QUICK_FIXTURES.intersection(getattr(item, "fixturenames", ()))
        if uses:
            heavy.append(f"{item.nodeid} is marked quick but uses {', '.join(sorted(uses))}")
    if heavy:
        raise pytest.UsageError("quick tests must stay quick:\n" + "\n".join(heavy))


def pytest_xdist_auto_num_workers(config):
    """``-n auto``: one test process more than the cores. A good part of the suite waits on servers (a real
    Milvus server flushing, indexing and loading collections; service processes starting), and the extra
    process keeps the cores busy meanwhile. PYTEST_XDIST_AUTO_NUM_WORKERS, where set, decides instead."""
    if os.environ.get("PYTEST_XDIST_AUTO_NUM_WORKERS"):
        return None
    return (os.cpu_count() or 1) + 1


def run_shared_folder(tmp_path_factory) -> Path:
    """A folder every test process of this run shares: pytest-xdist's workers' base temp folders are
    folders of the controller's."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


# What a built artefact (a starter bundle) depends on: the code and data that build it and the lock of
# every library it runs on. A change to any of them builds it anew; anything else reuses the last build.
BUILD_INPUTS = ("core", "training", "constraints.txt")


def build_inputs_digest(name: str, root: Path = ROOT) -> str:
    """sha256 over ``name``, the Python version and every file under ``BUILD_INPUTS`` (path and bytes)."""
    import hashlib

    digest = hashlib.sha256(f"{name}\0{sys.version_info[:2]}\0".encode())
    for top in BUILD_INPUTS:
        base = root / top
        files = [base] if base.is_file() else sorted(p for p in base.rglob("*") if p.is_file() and "__pycache__" not in p.parts)
        for path in files:
            digest.update(str(path.relative_to(root)).encode() + b"\0")
            digest.update(hashlib.sha256(path.read_bytes()).digest())
    return digest.hexdigest()


def build_cache_root() -> Path | None:
    """Where built artefacts outlive a run: ``PARASEEK_TEST_CACHE`` (empty: nowhere, each run builds
    its own), else ~/.cache/paraseek/tests."""
    value = os.environ.get("PARASEEK_TEST_CACHE")
    if value == "":
        return None
    return Path(value) if value else Path.home() / ".cache" / "paraseek" / "tests"


def built_once(tmp_path_factory, name: str, build) -> Path:
    """``build(path)``'s result, built once for every test process of this run and of later runs while
    what builds it is unchanged (``build_inputs_digest``): the first process to need it builds it into
    the cache (``build_cache_root()``, or this run's shared temporary folder where there is none) under
    a file lock while the others wait, then each takes a copy into its own base temp folder, where
    tests expect their files (a test may change its copy)."""
    import shutil

    from filelock import FileLock

    out = tmp_path_factory.mktemp(name) / name
    cache = build_cache_root()
    if cache is None:  # this run's test processes share one build
        cache = run_shared_folder(tmp_path_factory)
        entry = cache / f"built-once-{name}"
    else:
        entry = cache / f"{name}-{build_inputs_digest(name)[:16]}"
    cache.mkdir(parents=True, exist_ok=True)
    with FileLock(f"{entry}.lock"):
        if not (entry / "done").exists():
            shutil.rmtree(entry, ignore_errors=True)  # a build that was interrupted
            with _every_core():
                build(entry / name)
            (entry / "done").touch()
            for stale in cache.glob(f"{name}-*"):  # earlier builds of the same artefact from other code
                if stale.is_dir() and stale != entry and stale.name.rsplit("-", 1)[0] == name:
                    shutil.rmtree(stale, ignore_errors=True)
    shutil.copytree(entry / name, out)
    return out


@pytest.fixture(scope="session")
def starter_bundle(tmp_path_factory) -> Path:
    from paraseek.training.export.starter import build_starter

    return built_once(tmp_path_factory, "starter", lambda out: build_starter(out, int8=True))


@pytest.fixture(scope="session")
def whole_photo_starter_bundle(tmp_path_factory) -> Path:
    """The starter with the whole-photo image side (`build-starter --crop-grid 0`): the shipped text
    tower and classifier at one classifier pass per photo instead of ten. The service, index and
    load-test tests, which index photos many times over and test what happens to vectors rather than
    their quality, run on it (tests/whole_photo_starter.py names it ``starter_bundle`` there); elsewhere
    ``starter_bundle`` is the shipped default, crops included."""
    from paraseek.training.export.starter import build_starter

    return built_once(tmp_path_factory, "starter-whole-photo", lambda out: build_starter(out, int8=True, crop_grid=0))


@pytest.fixture(scope="session")
def embedded_starters(tmp_path_factory) -> Path:
    """The ``bundles`` folder of a PARASEEK_HOME as the embedded default's first start writes it: the robust
    starter (``starter-robust``) and its first-answer bundle, the plain starter (``starter``), one build."""
    def build(out: Path) -> None:
        from paraseek.training.export.starter import ROBUST_LAYERS, build_starter

        build_starter(out / "starter-robust", tuned_layers=ROBUST_LAYERS, plain_out=out / "starter")

    return built_once(tmp_path_factory, "embedded-starters", build)


@pytest.fixture(scope="session")
def starter_encoder(starter_bundle):
    from paraseek.core.encoder import Encoder

    # no activation arena: a session-long encoder would keep its largest batch's activations (about 400 MB
    # for the ten-view image tower) for the rest of the run in every test process
    return Encoder(starter_bundle, memory_arena=False)


@pytest.fixture(scope="session")
def starter_bank(starter_encoder, tmp_path_factory):
    """A small caption bank embedded by the starter."""
    return small_caption_bank(starter_encoder, tmp_path_factory)


def counting_encode_text(monkeypatch) -> list[int]:
    """How many texts each ``Encoder.encode_text`` call embeds, from here to the test's end."""
    from paraseek.core.encoder import Encoder

    calls: list[int] = []
    real = Encoder.encode_text

    def encode_text(self, texts, batch_size=64):
        calls.append(len(texts))
        return real(self, texts, batch_size)

    monkeypatch.setattr(Encoder, "encode_text", encode_text)
    return calls


def small_caption_bank(encoder, tmp_path_factory):
    """A small caption bank (the first 400 shipped captions) embedded by ``encoder``."""
    from paraseek.paraphrase.caption_bank import DEFAULT_TEXTS, CaptionBank, read_caption_texts

    return CaptionBank.build(encoder, read_caption_texts(DEFAULT_TEXTS)[:400], tmp_path_factory.mktemp("bank"))


@pytest.fixture(scope="session")
def tiny_clip(tmp_path_factory):
    """A tiny random-initialised open_clip model, saved as a checkpoint and exported from it."""
    import paraseek.training.torch_env  # noqa: F401  (torchvision shim before open_clip)
    import torch

    from paraseek.training.export.openclip import export_open_clip, load_open_clip

    tmp = tmp_path_factory.mktemp("tiny-clip")
    torch.manual_seed(0)
    model, _ = load_open_clip("", model_config=TINY_CLIP_CONFIG)
    ckpt = tmp / "tiny.pt"
    torch.save({"state_dict": model.state_dict()}, ckpt)
    bundle = tmp / "bundle"
    export_open_clip("tiny-clip", bundle, pretrained=str(ckpt), model_config=TINY_CLIP_CONFIG)
    reloaded, _ = load_open_clip("tiny-clip", pretrained=str(ckpt), model_config=TINY_CLIP_CONFIG)
    return bundle, reloaded, ckpt


# -- index backends: tests that take ``backend`` (or fixtures that do, like the service's
# ``make_settings``) run on FAISS; a module with ``BOTH_BACKENDS = True`` runs them on every registered one
from paraseek.index.backends import BACKENDS as STORE_BACKENDS  # noqa: E402

BACKENDS = list(STORE_BACKENDS)
_prefixes = iter(range(1_000_000))


# a module that also sets ``ON_MILVUS_SERVER = True`` runs them on a real Milvus standalone server too
# (backend "milvus-server", the run's one server: ``milvus_standalone``)
MILVUS_SERVER = "milvus-server"


def pytest_generate_tests(metafunc):
    if metafunc.definition.get_closest_marker("above_the_index"):
        return  # its subject never reaches the index backend: FAISS (the ``backend`` default) is enough
    if "backend" in metafunc.fixturenames and getattr(metafunc.module, "BOTH_BACKENDS", False):
        server = [MILVUS_SERVER] if getattr(metafunc.module, "ON_MILVUS_SERVER", False) else []
        metafunc.parametrize("backend", BACKENDS + server, indirect=True)


@pytest.fixture()
def backend(request) -> str:
    return getattr(request, "param", "faiss")


@pytest.fixture(scope="session")
def milvus_lite_uri(tmp_path_factory) -> Iterator[str]:
    """One Milvus Lite database (in this process) for the session; each test takes its own collection prefix."""
    from paraseek.index.milvus_store import stop_lite

    uri = str(tmp_path_factory.mktemp("milvus") / "paraseek.db")
    yield uri
    stop_lite(uri)  # now, not at exit: after its folder is removed (a passing run's) it would write it back


def fresh_prefix() -> str:
    return f"t{os.getpid()}_{next(_prefixes)}"


@pytest.fixture()
def milvus_store(milvus_lite_uri):
    """An empty Milvus store of its own (a fresh collection prefix in the session's Milvus Lite)."""
    from paraseek.index.milvus_store import MilvusStore

    return MilvusStore(milvus_lite_uri, prefix=fresh_prefix())


@pytest.fixture()
def milvus_server(tmp_path):
    """Milvus Lite as its own process, serving gRPC on loopback (what a Milvus server looks like to the
    service): ``uri``, ``stop()`` (kill -9), ``start()`` (again, same data, same port)."""
    import shutil
    import subprocess
    import sys

    from paraseek.loadtests.net import free_port, wait_listening

    port = free_port()
    data = tmp_path / "milvus-server"
    server: dict = {"uri": f"http://127.0.0.1:{port}", "port": port, "proc": None}

    def start():
        log = open(tmp_path / "milvus-server.log", "ab")
        server["proc"] = subprocess.Popen([sys.executable, "-m", "milvus_lite", "server", "--data-dir", str(data),
                                           "--host", "127.0.0.1", "--port", str(port)], stdout=log, stderr=log)
        if not wait_listening(port, 60, process=server["proc"]):
            pytest.fail(f"milvus_lite server is not listening: {(tmp_path / 'milvus-server.log').read_text()[-2000:]}")

    def stop():
        if server["proc"] is not None and server["proc"].poll() is None:
            server["proc"].kill()
            server["proc"].wait()

    server["start"], server["stop"] = start, stop
    start()
    yield server
    stop()
    shutil.rmtree(data, ignore_errors=True)


MILVUS_PORT_FLAGS = ("--proxy-port", "--etcd-port", "--root-coord-port", "--proxy-internal-port", "--query-coord-port",
                     "--query-node-port", "--index-coord-port", "--index-node-port", "--data-coord-port", "--data-node-port")
# each component registers, and is called, at "the first unicastable address" unless told: loopback only
MILVUS_LOOPBACK = [arg for component in ("rootCoord", "proxy", "queryCoord", "queryNode", "indexNode", "dataCoord", "dataNode")
                   for arg in ("--extra-config", f"{component}.ip=127.0.0.1")]
# The server's own clocks, shortened for a test server that holds a few hundred rows (measured on 2 cores,
# a 76-vector collection): the coordinators' polls (a copy 11.5 -> 8.6 s: loads, flushes, queries), a stop
# that gives up its graceful part after 3 s (10 s before our SIGKILL otherwise), and sessions that expire
# in 10 s, not 30, so a restarted server takes over its own stale sessions sooner (searchable again
# 36 -> 15 s after a stop and start)
MILVUS_TEST_CLOCKS = {"queryCoord.checkInterval": 200, "queryCoord.distPullInterval": 100, "proxy.timeTickInterval": 100,
                      "dataCoord.segment.assignmentExpiration": 500, "common.session.ttl": 10,
                      "common.gracefulStopTimeout": 3}
MILVUS_TEST_CONFIG = MILVUS_LOOPBACK + [arg for key, value in MILVUS_TEST_CLOCKS.items()
                                        for arg in ("--extra-config", f"{key}={value}")]


class MilvusStandalone:
    """A real Milvus 2.3.5 standalone server (the `milvus` package's binary: its own etcd, coordinators,
    query, index and data nodes, local storage) on free ports; ``stop()`` and ``start()`` again keep its
    ports and data, as a restart does.

    The first start goes through the package's ``milvus-server`` wrapper, which writes the server's
    configuration and starts ``milvus run standalone``. A restart runs that server process again as it
    was (command, folder, environment), as an orchestrator restarts a container: the wrapper checks each
    port with a bind that TIME_WAIT connections of the stopped server refuse, and then silently moves
    that component to the next port (the proxy answered on port + 1 after a restart)."""

    def __init__(self, exe: Path, data: Path):
        from paraseek.loadtests.net import free_port

        self.exe, self.data = exe, data
        self.ports = {flag: free_port() for flag in MILVUS_PORT_FLAGS}
        self.uri = f"http://127.0.0.1:{self.ports['--proxy-port']}"
        self.proc = None
        self.server_run: dict | None = None  # how the wrapper ran the server: args, cwd, env
        # the embedded etcd's peer port has no flag (2380 by default: a second server on the machine
        # would fail to bind it): an etcd configuration file of its own sets it
        peer, client = f"http://127.0.0.1:{free_port()}", f"http://127.0.0.1:{self.ports['--etcd-port']}"
        self.etcd_config = data / "embed-etcd.yaml"
        self.etcd_config.write_text(json.dumps({
            "name": "default", "data-dir": str(data / "data" / "data" / "etcd.data"),
            "listen-peer-urls": peer, "initial-advertise-peer-urls": peer, "initial-cluster": f"default={peer}",
            "listen-client-urls": client, "advertise-client-urls": client,
        }))

    def start(self) -> None:
        import subprocess

        from paraseek.loadtests.net import wait_listening

        from filelock import FileLock

        # one server starting at a time on this machine: the wrapper picks the metrics port (from 9091
        # up, no flag) by probing, and two servers starting together probe the same free port
        with FileLock(Path(tempfile.gettempdir()) / "paraseek-milvus-standalone.lock"):
            log = open(self.data / "server.log", "ab")
            if self.server_run is None:
                self.proc = subprocess.Popen([str(self.exe), "--data", str(self.data / "data"),
                                              *[str(x) for kv in self.ports.items() for x in kv], *MILVUS_TEST_CONFIG],
                                             stdout=log, stderr=log,
                                             # Milvus reads etcd.config.path from the environment (the wrapper's
                                             # template has no such key for --extra-config to set)
                                             env={**os.environ, "ETCD_CONFIG_PATH": str(self.etcd_config)})
            else:
                self.proc = subprocess.Popen(self.server_run["args"], cwd=self.server_run["cwd"], env=self.server_run["env"],
                                             stdout=log, stderr=log)
            log.close()
            started = wait_listening(self.ports["--proxy-port"], 180, process=self.proc) and self._answers(180)
            if started and self.server_run is None:
                self.server_run = self._server_run()
        if not started:
            self.stop()
            logs = "".join(p.read_text()[-2000:] for p in [self.data / "server.log", *sorted((self.data / "data" / "logs").glob("*.log"))]
                           if p.is_file())
            pytest.fail(f"Milvus standalone did not start: {logs}")

    def _server_pids(self) -> list[int]:
        server = str(self.data / "data" / "bin" / "milvus")
        return [int(p.name) for p in Path("/proc").iterdir() if p.name.isdigit() and _cmdline(p).startswith(server)]

    def _server_run(self) -> dict:
        """The wrapper's child, `milvus run standalone`, as it runs: its arguments, folder and environment."""
        (pid,) = self._server_pids()
        proc = Path(f"/proc/{pid}")
        env = dict(item.split("=", 1) for item in proc.joinpath("environ").read_bytes().decode().split("\0") if "=" in item)
        return {"args": proc.joinpath("cmdline").read_bytes().decode().split("\0")[:-1], "cwd": os.readlink(proc / "cwd"),
                "env": env}

    def _answers(self, timeout_s: float) -> bool:
        """Until the server answers a request: its proxy port accepting connections is not enough (the
        wrapper binds every port for a moment to check that it is free, before the server starts)."""
        from pymilvus import MilvusClient

        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and self.proc is not None and self.proc.poll() is None:
            try:
                client = MilvusClient(self.uri, timeout=5)
                client.list_collections()
                client.close()
                return True
            except Exception:
                time.sleep(0.5)
        return False

    def stop(self, grace_s: float = 10.0) -> None:
        """SIGTERM to the wrapper and to the `milvus run standalone` it starts in a session of its own,
        SIGKILL after ``grace_s`` (the server ends its graceful stop after 3 s: ``MILVUS_TEST_CLOCKS``)."""
        if self.proc is None:
            return
        stop_processes(self.pids(), grace_s, reap=self.proc.poll)
        self.proc.wait(10)
        self.proc = None

    def pids(self) -> list[int]:
        return [self.proc.pid, *self._server_pids()] if self.proc is not None else []


def stop_processes(pids: list[int], grace_s: float, reap=lambda: None) -> None:
    """SIGTERM to a Milvus standalone's processes, SIGKILL after ``grace_s``; then its leftovers."""
    import signal

    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 10.0)):
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline and any(_running(pid) for pid in pids):
            reap()
            time.sleep(0.2)
    for pid in pids:  # the server records its id in a runtime folder no flag moves, and leaves it
        for runtime in ("/run/milvus", "/tmp/milvus"):
            Path(runtime, f"server_id_{pid}").unlink(missing_ok=True)


def _milvus_server_exe() -> Path:
    exe = Path(sys.executable).parent / "milvus-server"
    if not exe.is_file():
        pytest.skip("the milvus package (a Milvus 2.3.5 standalone server, Linux x86_64 only) is not installed")
    return exe


@dataclass(frozen=True)
class SharedMilvusStandalone:
    """The run's Milvus standalone server as a test sees it: its address only (no stop or start: other
    test processes use it at the same time)."""

    uri: str


SHARED_MILVUS_RECORD = "milvus-standalone.json"


@pytest.fixture(scope="session")
def milvus_standalone(tmp_path_factory) -> SharedMilvusStandalone:
    """One real Milvus standalone server (see ``MilvusStandalone``) for the whole run, started by the
    first test process that needs it and shared by all of them (each test takes collection prefixes of
    its own); the run's end stops it (``pytest_sessionfinish``). A module that stops or restarts the
    server takes one of its own instead: ``own_milvus_standalone``."""
    from filelock import FileLock

    exe = _milvus_server_exe()
    shared = run_shared_folder(tmp_path_factory)
    record = shared / SHARED_MILVUS_RECORD
    with FileLock(f"{record}.lock"):
        if not record.exists():
            data = shared / "milvus-standalone"
            data.mkdir()
            server = MilvusStandalone(exe, data)
            server.start()
            record.write_text(json.dumps({"uri": server.uri, "pids": server.pids()}))
    return SharedMilvusStandalone(json.loads(record.read_text())["uri"])


def pytest_sessionfinish(session, exitstatus):
    """The run's shared Milvus server stops with the run: in the process that ran the tests, or in
    pytest-xdist's controller once every worker is done."""
    if hasattr(session.config, "workerinput"):
        return
    factory = getattr(session.config, "_tmp_path_factory", None)
    record = factory.getbasetemp() / SHARED_MILVUS_RECORD if factory is not None else None
    if record is not None and record.is_file():
        stop_processes(json.loads(record.read_text())["pids"], grace_s=0)
        record.unlink()


@pytest.fixture(scope="module")
def own_milvus_standalone(tmp_path_factory):
    """A real Milvus standalone server of the test module's own, which it may stop and start again."""
    server = MilvusStandalone(_milvus_server_exe(), tmp_path_factory.mktemp("milvus-standalone"))
    server.start()
    try:
        yield server
    finally:
        server.stop(grace_s=0)  # its data goes with the test's temporary folder


def _cmdline(proc_dir: Path) -> str:
    try:
        return (proc_dir / "cmdline").read_bytes().split(b"\0")[0].decode(errors="replace")
    except OSError:
        return ""


def _running(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ", 1)[1][0] != "Z"  # a zombie has exited
    except (OSError, IndexError):
        return False
