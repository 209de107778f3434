"""Small network helpers of the benchmarks (and the tests, which start servers the same way)."""

from __future__ import annotations

import socket


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that is free on ``host`` right now (the OS picks it)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def wait_listening(port: int, timeout_s: float, host: str = "127.0.0.1", process=None) -> bool:
    """Wait until something accepts TCP connections on ``host:port``; False on timeout, or as soon as
    ``process`` (a ``subprocess.Popen`` that should be the listener) has exited."""
    import time

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with socket.create_connection((host, port), timeout=0.2):
                return True
        except OSError:
            if process is not None and process.poll() is not None:
                return False
            time.sleep(0.05)
    return False
