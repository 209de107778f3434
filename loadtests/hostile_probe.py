"""A hostile user and a careless indexer against a real ``paraseek serve``: every public route with
malformed, oversized and malicious input (status counts; any 5xx is a failure), slow bodies held open
(the server's RSS while they are held and after they time out), and a reindex of a folder holding a
20 GB file (the server's RSS during that build).

    python -m paraseek.loadtests.hostile_probe [--slow-bodies 200] [--home DIR] [--checkout OLD_CHECKOUT]

Serves the embedded default from ``--home`` (a temporary folder: built on first start, about 25 s).
Exits 1 when any request answered 5xx, or a slow body was never given up.
"""

from __future__ import annotations

import argparse
import base64
import json
import shutil
import socket
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import httpx

from paraseek.loadtests.server import start_server, stop_server

TOKEN = "hostile-probe-admin-token"


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def hostile_requests(root: Path) -> list[tuple[str, str, dict]]:
    """(method, path, httpx keyword arguments) of input a service must refuse with a 4xx, or answer."""
    admin = {"Authorization": f"Bearer {TOKEN}"}
    nested = "[" * 5000 + "]" * 5000
    svg = b'<svg xmlns="http://www.w3.org/2000/svg"><script>alert(1)</script></svg>'
    searches = [
        {"query": "a dog", "filter": {"caption_contains": "dog\" or id > 0 or caption_text like \"\n"}},
        {"query": "a dog", "filter": {"fields": {"x": "a\tb"}}},
        {"query": "a dog", "filter": {"id_range": {"gte": 2**70}}},
        {"query": "a dog", "k": 10**9}, {"query": "a dog", "k": -1}, {"query": "a dog", "offset": 10**6},
        {"query": "\x00" * 100}, {"query": "a" * 100_000}, {"query": ["a dog"]}, {"query": {"$gt": ""}},
        {"query": "a dog", "expansion": {"method": "generator", "n": 16}, "consistency": {"auto": 16, "method": "llm"}},
        {"query": "a dog", "expansion": {"method": "../../etc/passwd"}},
        {"query": "a dog", "consistency": {"auto": 16}},
        {"terms": [{"text": "a dog", "weight": 1e308}] * 1000},
    ]
    out: list[tuple[str, str, dict]] = [("POST", "/v1/search", {"json": body}) for body in searches]
    out += [("POST", "/v1/search", {"content": nested, "headers": {"content-type": "application/json"}}),
            ("POST", "/v1/search", {"content": b"\xff\xfe" * 100, "headers": {"content-type": "application/json"}}),
            ("POST", "/v1/search", {"content": b"x" * (9 << 20), "headers": {"content-type": "application/json"}})]
    out += [("GET", f"/v1/images/{image_id}", {}) for image_id in
            ("9999999999999999999", "99999999999999999999", "-1", "0", "1e3", "%2e%2e%2fetc%2fpasswd", "377575.jpg")]
    out += [("POST", "/v1/search/batch", {"json": {"requests": [{"query": f"a dog {i}"} for i in range(65)]}}),
            ("POST", "/v1/search/batch", {"json": {"requests": [{"query": "a dog", "k": 10**9}]}}),
            ("POST", "/v1/search/similar", {"json": {"id": 2**63}}),
            ("POST", "/v1/search/similar", {"json": {"id": "377575"}}),
            ("POST", "/v1/search/image", {"files": {"image": ("x.svg", svg, "image/svg+xml")}}),
            ("POST", "/v1/search/image", {"files": {"image": ("x.jpg", b"\xff\xd8\xff" + b"\x00" * 100, "image/jpeg")}}),
            ("POST", "/v1/search/image", {"json": {"image": base64.b64encode(b"not an image").decode()}}),
            ("POST", "/v1/embeddings", {"json": {"input": ["a dog"] * 100_000}}),
            ("POST", "/v1/embeddings", {"json": {"input": "a dog", "model": "../../etc/passwd"}}),
            ("GET", "/v1/models", {}), ("GET", "/v1/info", {}), ("GET", "/metrics", {}), ("GET", "/", {}),
            ("GET", "/readyz", {}), ("GET", "/healthz", {})]
    out += [("POST", "/v1/admin/reindex", {"json": {"source": "/etc"}, "headers": admin}),
            ("POST", "/v1/admin/reindex", {"json": {"source": str(root / "{0..999999999}.tar")}, "headers": admin}),
            ("POST", "/v1/admin/reindex", {"json": {"source": str(root / "../../etc/passwd")}, "headers": admin}),
            ("POST", "/v1/admin/reindex", {"json": {"source": str(root)}, "headers": {"Authorization": "Bearer change-me"}}),
            ("POST", "/v1/admin/reload", {"json": {"bundle": "/etc"}, "headers": admin}),
            ("POST", "/v1/admin/activate", {"json": {"version": "v99999-20260101T000000Z"}, "headers": admin}),
            ("POST", "/v1/admin/activate", {"json": {"version": "../../etc"}, "headers": admin}),
            ("GET", "/v1/admin/jobs/../../etc/passwd", {"headers": admin}),
            ("POST", "/v1/admin/jobs/nope/cancel", {"headers": admin}),
            ("GET", "/v1/admin/versions", {}), ("GET", "/v1/admin/jobs", {"headers": admin})]
    return out


def probe_routes(url: str, root: Path) -> Counter:
    statuses: Counter = Counter()
    with httpx.Client(base_url=url, timeout=120) as client:
        for method, path, kwargs in hostile_requests(root):
            try:
                r = client.request(method, path, **kwargs)
            except httpx.HTTPError as exc:  # the server cut the connection, or is gone
                statuses[type(exc).__name__] += 1
                print(f"  no answer: {method} {path[:80]} -> {type(exc).__name__}")
                continue
            statuses[r.status_code] += 1
            if r.status_code >= 500:
                print(f"  5xx: {method} {path} -> {r.status_code} {r.text[:200]}")
    return statuses


def probe_slow_bodies(url: str, pid: int, count: int, timeout_s: float) -> dict:
    """``count`` connections at once, each declaring an 8 MiB image upload and sending all of it but the
    last byte: the server's peak RSS while they are held, and what each was answered."""
    import threading

    host, port = url.removeprefix("http://").split(":")
    declared = 8 << 20
    head = (f"POST /v1/search/image HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {declared}\r\n\r\n").encode()
    answers: Counter = Counter()
    lock = threading.Lock()

    def hold() -> None:
        with socket.create_connection((host, int(port))) as s:
            s.settimeout(10)
            try:
                s.sendall(head + b"\0" * (declared - 1))
            except OSError:  # the server stopped reading it (refused at once)
                pass
            s.settimeout(timeout_s + 30)
            try:
                status = s.recv(64).split(b" ")[1:2]
                answer = int(status[0]) if status and status[0].isdigit() else "closed"
            except OSError:
                answer = "no answer"
        with lock:
            answers[answer] += 1

    before = rss_mb(pid)
    started = time.monotonic()
    threads = [threading.Thread(target=hold, daemon=True) for _ in range(count)]
    for t in threads:
        t.start()
    peak = before
    while any(t.is_alive() for t in threads):
        peak = max(peak, rss_mb(pid))
        time.sleep(0.2)
    return {"rss_before_mb": round(before), "rss_peak_mb": round(peak), "rss_after_mb": round(rss_mb(pid)),
            "answers": {str(k): v for k, v in answers.items()}, "all_answered_after_s": round(time.monotonic() - started, 1)}


def probe_big_file(url: str, pid: int, root: Path) -> dict:
    """A reindex of three photos and a 20 GB (sparse) file: the server's RSS while it builds."""
    from paraseek.core.demo import GALLERY_DIR

    folder = root / "big-file"
    folder.mkdir()
    for photo in sorted(GALLERY_DIR.glob("*.jpg"))[:3]:
        shutil.copy(photo, folder / photo.name)
    with open(folder / "video.mp4", "wb") as f:
        f.truncate(20 << 30)
    admin = {"Authorization": f"Bearer {TOKEN}"}
    before, peak = rss_mb(pid), 0.0
    with httpx.Client(base_url=url, timeout=60) as client:
        job = client.post("/v1/admin/reindex", json={"source": str(folder)}, headers=admin).json()
        while True:
            peak = max(peak, rss_mb(pid))
            state = client.get(f"/v1/admin/jobs/{job['id']}", headers=admin).json()
            if state["state"] not in ("queued", "running"):
                break
            time.sleep(0.05)
    skipped = (state.get("report") or {}).get("skipped", [])
    return {"state": state["state"], "skipped": [(s["path"], s["error"]) for s in skipped],
            "rss_before_mb": round(before), "rss_peak_mb": round(peak)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--home", type=Path, default=None, help="PARASEEK_HOME (default: a temporary folder)")
    p.add_argument("--slow-bodies", type=int, default=200, help="connections that each hold an almost complete body")
    p.add_argument("--checkout", type=Path, default=None,
                   help="serve the code of another checkout of this repository (an older commit: the before)")
    args = p.parse_args(argv)
    home = args.home or Path(tempfile.mkdtemp(prefix="paraseek-probe-"))
    root = Path(tempfile.mkdtemp(prefix="paraseek-probe-root-"))
    proc, url = start_server({"PARASEEK_HOME": str(home), "PARASEEK_ADMIN_TOKEN": TOKEN,
                              "PARASEEK_REINDEX_ROOT": str(root), "PARASEEK_LOG_JSON": "false"},
                             log=home / "probe-server.log", timeout=300, checkout=args.checkout)
    try:
        from paraseek.service.main import BODY_READ_TIMEOUT_S

        statuses = probe_routes(url, root)
        print(f"routes: {sum(statuses.values())} hostile requests, statuses {dict(sorted(statuses.items(), key=str))}")
        slow = probe_slow_bodies(url, proc.pid, args.slow_bodies, BODY_READ_TIMEOUT_S)
        print(f"slow bodies: {args.slow_bodies} connections x 8 MiB - 1 byte: {json.dumps(slow)}")
        big = probe_big_file(url, proc.pid, root)
        print(f"big file: {json.dumps(big)}")
    finally:
        stop_server(proc)
        shutil.rmtree(root, ignore_errors=True)
        if args.home is None:
            shutil.rmtree(home, ignore_errors=True)
    failed = sum(n for status, n in statuses.items() if not isinstance(status, int) or status >= 500)
    never_given_up = sum(n for answer, n in slow["answers"].items() if answer == "no answer")
    return 1 if failed or never_given_up else 0


if __name__ == "__main__":
    sys.exit(main())
