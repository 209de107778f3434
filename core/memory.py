"""Giving freed memory back to the operating system, and keeping the collector off the long-lived
heap (long-running servers) and out of bulk bookkeeping (``collection_paused``).

A reload or reindex frees a whole encoder or index, and a reindex's decoding threads and batch
activations free hundreds of MB; glibc keeps freed blocks in per-thread arenas, so the process's RSS
keeps its peak unless asked to trim. Linux/glibc only; elsewhere these are no-ops.
"""

from __future__ import annotations

import ctypes
import gc
import logging
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

log = logging.getLogger(__name__)
M_ARENA_MAX = -8  # mallopt parameter (glibc malloc.h)


@lru_cache(maxsize=1)
def _libc():
    """The C library already loaded in this process (looked up once; no find_library subprocess)."""
    try:
        libc = ctypes.CDLL(None)
    except OSError:
        return None
    return libc if hasattr(libc, "malloc_trim") and hasattr(libc, "mallopt") else None


def limit_malloc_arenas(count: int = 2) -> bool:
    """Cap glibc's malloc arenas (default 8 per core): threads that come and go (decoding, to_thread)
    then share a few arenas instead of each keeping its own free memory."""
    libc = _libc()
    return bool(libc and libc.mallopt(M_ARENA_MAX, count))


def release_free_memory() -> None:
    """Collect garbage cycles, then return free heap pages to the OS."""
    gc.collect()
    libc = _libc()
    if libc is not None:
        libc.malloc_trim(0)


def freeze_long_lived() -> None:
    """Move every object alive now out of the cyclic collector's reach (``gc.freeze``). A server's
    long-lived state (modules, routes, WordNet, sessions: about 120K objects in the service) is
    otherwise traversed by every full collection, a 40-120 ms pause of all requests under load, the
    whole of the service's p99 at concurrency 32. Unfrozen and collected first, so that what a reload
    replaced (frozen the time before) is freed rather than kept forever."""
    gc.unfreeze()
    release_free_memory()
    gc.freeze()


# cgroup v1 writes "no limit" as the largest page-aligned signed 64-bit number; anything past 2**60
# bytes is no limit either way
NO_LIMIT = 2**60


def available_memory_bytes(meminfo: str = "/proc/meminfo", proc_cgroup: str = "/proc/self/cgroup",
                           cgroup_root: str = "/sys/fs/cgroup") -> float:
    """What this process can still take: the host's MemAvailable, or less where its memory cgroup (a
    container's or a pod's limit) has less room. Elsewhere, or unreadable, 8 GiB."""
    host = None
    try:
        with open(meminfo) as f:
            host = next((float(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:")), None)
    except OSError:
        pass
    room = cgroup_memory_room(proc_cgroup, cgroup_root)
    known = [v for v in (host, room) if v is not None]
    return min(known) if known else float(8 * 2**30)


def cgroup_memory_room(proc_cgroup: str = "/proc/self/cgroup", cgroup_root: str = "/sys/fs/cgroup") -> float | None:
    """Bytes left under the tightest memory limit of this process's cgroup and its ancestors (v2's
    memory.max, v1's memory.limit_in_bytes): the limit less what is in use, reclaimable file cache
    (inactive_file) not counted, as the kernel and the kubelet count a working set. None: no limit."""
    try:
        lines = Path(proc_cgroup).read_text().splitlines()
    except OSError:
        return None
    rooms = []
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "":  # v2: one unified hierarchy
            files, base = ("memory.max", "memory.current", "inactive_file"), Path(cgroup_root)
        elif "memory" in controllers.split(","):
            files, base = ("memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file"), Path(cgroup_root) / "memory"
        else:
            continue
        # in a container the listed path may not exist under the mount (a cgroup namespace shows "/"):
        # each ancestor that does counts, the mount's own root last
        here = Path(path)
        for folder in (base / here.relative_to("/"), *(base / p.relative_to("/") for p in here.parents)):
            room = _cgroup_room(folder, *files)
            if room is not None:
                rooms.append(room)
    return min(rooms) if rooms else None


def _cgroup_room(folder: Path, limit_file: str, usage_file: str, inactive_key: str) -> float | None:
    try:
        limit_text = (folder / limit_file).read_text().strip()
        if limit_text == "max" or int(limit_text) >= NO_LIMIT:
            return None
        usage = int((folder / usage_file).read_text())
    except (OSError, ValueError):
        return None
    inactive = 0
    try:
        for stat in (folder / "memory.stat").read_text().splitlines():
            key, _, value = stat.partition(" ")
            if key == inactive_key:
                inactive = int(value)
    except (OSError, ValueError):
        pass
    return float(max(int(limit_text) - max(usage - inactive, 0), 0))


_pause_lock = threading.Lock()
_pauses = 0
_enable_after = False


@contextmanager
def collection_paused() -> Iterator[None]:
    """The cyclic collector off for a block that allocates millions of small objects holding no cycles (a
    build's listing, stamps and metadata rows): each allocation burst otherwise sets off collections that
    traverse every record alive, 70 % of finding 100,000 unchanged photos' vectors. Refcounting still frees
    everything. Blocks may overlap across threads: the collector comes back with the last one, and only if
    it was on before the first. The switch is the process's: a service's request cycles made meanwhile wait
    for the block to end (seconds, even at a million files), which costs memory, not correctness."""
    global _pauses, _enable_after
    with _pause_lock:
        if _pauses == 0:
            _enable_after = gc.isenabled()
            gc.disable()
        _pauses += 1
    try:
        yield
    finally:
        with _pause_lock:
            _pauses -= 1
            if _pauses == 0 and _enable_after:
                gc.enable()


@dataclass(frozen=True)
class ProcessMemory:
    """A process's resident memory in MB: all of it, the private part (anonymous and shared-memory
    pages: what only this process can hold) and the file-backed part (page cache of mapped files,
    such as a memory-mapped index, which the kernel may drop and re-read)."""

    rss_mb: float
    private_mb: float
    file_mb: float


def process_memory(pid: int | str = "self") -> ProcessMemory:
    """``ProcessMemory`` of a process from /proc/PID/status (Linux); NaN where it cannot be read."""
    fields: dict[str, float] = {}
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                name, _, value = line.partition(":")
                if name in ("VmRSS", "RssAnon", "RssFile", "RssShmem"):
                    fields[name] = int(value.split()[0]) / 1024
    except (OSError, ValueError):
        pass
    nan = float("nan")
    return ProcessMemory(fields.get("VmRSS", nan), fields.get("RssAnon", nan) + fields.get("RssShmem", 0.0),
                         fields.get("RssFile", nan))


class MemorySampler:
    """A process's resident memory every ``interval`` s while a phase runs: the peak of its RSS and of
    its private part (``process_memory``), in MB."""

    def __init__(self, pid: int | str = "self", interval: float = 0.1):
        self.pid, self.interval = pid, interval
        self.peak_rss = self.peak_private = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            now = process_memory(self.pid)
            self.peak_rss = max(self.peak_rss, now.rss_mb)  # NaN once the process is gone: max keeps the peak
            self.peak_private = max(self.peak_private, now.private_mb)
            self._stop.wait(self.interval)

    def start(self) -> MemorySampler:
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop sampling (again: a no-op); the moment of stopping counts, however short the phase."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()
        now = process_memory(self.pid)
        self.peak_rss, self.peak_private = max(self.peak_rss, now.rss_mb), max(self.peak_private, now.private_mb)

    def __enter__(self) -> MemorySampler:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
