"""Giving freed memory back to the operating system, and keeping the collector off the long-lived
heap (long-running servers).

A reload or reindex frees a whole encoder or index, and a reindex's decoding threads and batch
activations free hundreds of MB; glibc keeps freed blocks in per-thread arenas, so the process's RSS
keeps its peak unless asked to trim. Linux/glibc only; elsewhere these are no-ops.
"""

from __future__ import annotations

import ctypes
import gc
import logging
from functools import lru_cache

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
