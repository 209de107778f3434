"""Start ``paraseek serve`` as a subprocess on loopback and wait until it is ready (warm): shared by
the benchmarks, the soak run and the tests that need a real server."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import httpx

from paraseek.loadtests.net import free_port


class ServerNotReady(RuntimeError):
    pass


def wait_ready(url: str, proc: subprocess.Popen | None = None, timeout: float = 120, log: Path | None = None) -> None:
    """Poll ``/readyz`` until 200; fail early if the process exits."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc is not None and proc.poll() is not None:
            break
        try:
            if httpx.get(url + "/readyz", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    tail = log.read_text()[-2000:] if log is not None and log.is_file() else ""
    raise ServerNotReady(f"{url} did not become ready{' (the server exited)' if proc and proc.poll() is not None else ''}: {tail}")


def start_server(env: dict[str, str], log: Path | None = None, port: int | None = None,
                 timeout: float = 120, checkout: Path | None = None) -> tuple[subprocess.Popen, str]:
    """(process, url) of a ready server with ``PARASEEK_*`` settings from ``env`` (added to ours);
    ``checkout``: run the code of another checkout of this repository (an older commit, to compare
    with under the same load generator) instead of ours."""
    port = port or free_port()
    out = open(log, "w") if log is not None else subprocess.DEVNULL
    env = {**os.environ, **env}
    if checkout is not None:
        # ``python -m`` puts the working directory first on sys.path: the checkout's packages win
        env["PYTHONPATH"] = str(checkout)
    proc = subprocess.Popen([sys.executable, "-m", "paraseek.cli", "serve", "--port", str(port)],
                            env=env, cwd=checkout, stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(url, proc, timeout, log)
    except ServerNotReady:
        proc.kill()
        raise
    return proc, url


def stop_server(proc: subprocess.Popen, grace_s: float = 20) -> None:
    """SIGTERM (a graceful shutdown), then SIGKILL if it has not exited within ``grace_s``."""
    proc.terminate()
    try:
        proc.wait(grace_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
