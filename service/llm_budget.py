"""LLM endpoint calls per client: a token bucket for each client address, so one client cannot spend
the endpoint (its latency, its quota) for everyone."""

from __future__ import annotations

import threading
import time
from typing import Callable

from cachetools import LRUCache

# clients remembered at once (about 200 bytes each); the least recently seen are forgotten first
MAX_CLIENTS = 100_000


class ClientBudget:
    """``per_minute`` calls a client, refilled continuously; a client holds at most a minute's worth."""

    def __init__(self, per_minute: int, clock: Callable[[], float] = time.monotonic):
        self.per_minute = per_minute
        self.clock = clock
        self._buckets: LRUCache[str, tuple[float, float]] = LRUCache(MAX_CLIENTS)  # client -> (tokens, when)
        self._lock = threading.Lock()

    def take(self, client: str, calls: int) -> float | None:
        """Spend ``calls`` of ``client``'s budget: None when granted, else the seconds until it would be
        (nothing is spent then)."""
        now = self.clock()
        with self._lock:
            tokens, when = self._buckets.get(client, (float(self.per_minute), now))
            tokens = min(float(self.per_minute), tokens + (now - when) * self.per_minute / 60)
            if calls > tokens:
                self._buckets[client] = (tokens, now)
                return (calls - tokens) * 60 / self.per_minute
            self._buckets[client] = (tokens - calls, now)
            return None
