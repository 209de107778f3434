"""LLM endpoint calls per client: a token bucket for each client address, so one client cannot spend
the endpoint (its latency, its quota) for everyone."""

from __future__ import annotations

import threading
import time
from typing import Callable

from cachetools import LRUCache

from paraseek.core.settings import Settings
from paraseek.paraphrase.factory import source_configured
from paraseek.paraphrase.llm import endpoint_calls
from paraseek.service.errors import RequestError
from paraseek.service.query_plan import rewrite_expansion
from paraseek.service.schemas import SearchRequest

LLM_CALLS_PER_REQUEST = 24  # e.g. a generator expansion of 8 and an llm consistency report of 6
LLM_CALLS_PER_CLIENT_MINUTE = 120  # five such requests a minute from one address
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


def check_endpoint_calls(req: SearchRequest, settings: Settings, budget: ClientBudget, client: str) -> None:
    """At most ``LLM_CALLS_PER_REQUEST`` LLM endpoint calls a request (its expansion and its consistency
    report's paraphrases together), and ``budget``'s share a client address, refused before the first:
    one request, or one client, cannot spend the endpoint's time or quota."""
    method = rewrite_expansion(req)
    asked = []  # (field, calls) of the sources configured: an unconfigured one is refused (400) without a call
    if method is not None and req.expansion is not None and source_configured(method.source, settings):
        asked.append(("expansion.n", endpoint_calls(method.source, req.expansion.n)))
    c = req.consistency
    if c is not None and c.auto is not None and source_configured(c.method, settings):
        asked.append(("consistency.auto", endpoint_calls(c.method, c.auto)))
    total = sum(calls for _, calls in asked)
    if not total:
        return
    field = max(asked, key=lambda pair: pair[1])[0]
    if total > LLM_CALLS_PER_REQUEST:
        raise RequestError(field, f"the request would take up to {total} LLM endpoint calls, more than the "
                                  f"{LLM_CALLS_PER_REQUEST} a request may: ask for fewer paraphrases")
    wait = budget.take(client, total)
    if wait is not None:
        raise RequestError(field, f"this client's LLM endpoint calls are spent ({budget.per_minute} a "
                                  f"minute): retry in {wait:.0f} s", status=429)
