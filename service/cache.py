"""Query-embedding and result caches: Redis when configured, else an in-process LRU.

Redis errors or timeouts never fail a request: the lookup counts as a miss, a warning is logged and
a metric counts it. A circuit breaker decides when to stop asking Redis: a refused connection opens it
at once, timeouts only after several in a row (one slow call must not switch the cache off for every
client). While open, one probe is let through every ``retry_after_s``; its success closes the breaker.
The connection pool checks idle connections and retries a command once on a fresh connection, so a
Redis restart costs no cache-less pause.
"""

from __future__ import annotations

import hashlib
import logging
import time

import numpy as np
import orjson
from cachetools import LRUCache

log = logging.getLogger(__name__)


def params_key(params: dict) -> str:
    return hashlib.sha1(orjson.dumps(params, option=orjson.OPT_SORT_KEYS | orjson.OPT_NON_STR_KEYS, default=str)).hexdigest()


BREAKER_STATE_VALUE = {"closed": 0.0, "half-open": 0.5, "open": 1.0}  # paraseek_cache_breaker_state


class CircuitBreaker:
    """closed -> open after ``failures_to_open`` consecutive failures (or one refused connection);
    open -> half-open after ``open_s``: exactly one probe call goes through; its success closes the
    breaker, its failure opens it again."""

    def __init__(self, failures_to_open: int = 3, open_s: float = 5.0, clock=time.monotonic):
        self.failures_to_open = failures_to_open
        self.open_s = open_s
        self.clock = clock
        self.state = "closed"
        self.failures = 0
        self._opened_at = 0.0

    def allow(self) -> bool:
        if self.state == "closed":
            return True
        if self.state == "open" and self.clock() - self._opened_at >= self.open_s:
            self.state = "half-open"  # this caller is the probe; others wait for its verdict
            return True
        return False

    def success(self) -> None:
        self.state, self.failures = "closed", 0

    def failure(self, refused: bool = False) -> bool:
        """Record a failure; True when the breaker (re)opened."""
        self.failures += 1
        if refused or self.state == "half-open" or self.failures >= self.failures_to_open:
            self.state, self._opened_at = "open", self.clock()
            return True
        return False


class Cache:
    def __init__(self, metrics, redis_url: str | None = None, *, timeout_s: float = 0.25, connect_timeout_s: float = 0.25,
                 retry_after_s: float = 5.0, failures_to_open: int = 3, embedding_ttl_s: int = 604800,
                 result_ttl_s: int = 600, lru_size: int = 10_000):
        self.metrics = metrics
        self.embedding_ttl_s = embedding_ttl_s
        self.result_ttl_s = result_ttl_s
        self.breaker = CircuitBreaker(failures_to_open, retry_after_s)
        metrics.cache_breaker.set_function(lambda: BREAKER_STATE_VALUE[self.breaker.state])
        self._redis = None
        self._lru: LRUCache[str, bytes] | None = LRUCache(maxsize=max(lru_size, 1)) if lru_size else None
        if redis_url:
            import redis.asyncio as redis
            from redis.asyncio.retry import Retry
            from redis.backoff import NoBackoff
            from redis.exceptions import ConnectionError as RedisConnectionError

            self._redis = redis.from_url(
                redis_url, socket_timeout=timeout_s, socket_connect_timeout=connect_timeout_s,
                # a pooled connection that died with a Redis restart fails once, then the command is
                # retried on a fresh connection; idle connections are checked before reuse
                retry=Retry(NoBackoff(), 1), retry_on_error=[RedisConnectionError], health_check_interval=30,
            )
        self.backend = "redis" if self._redis else ("lru" if self._lru is not None else "off")

    # -- backend primitives ------------------------------------------------------------------
    def _redis_usable(self) -> bool:
        return self._redis is not None and self.breaker.allow()

    def _redis_failed(self, exc: Exception) -> None:
        from redis.exceptions import ConnectionError as RedisConnectionError

        self.metrics.cache_errors.inc()
        refused = isinstance(exc, (RedisConnectionError, ConnectionRefusedError))
        if self.breaker.failure(refused=refused):
            log.warning("redis unavailable, serving without cache; probing again in %.1fs: %s", self.breaker.open_s, exc)
        else:
            log.warning("redis call failed (%d in a row), still using the cache: %s", self.breaker.failures, exc)

    async def _get_many(self, keys: list[str]) -> list[bytes | None]:
        if self._redis is not None:
            if not self._redis_usable():
                return [None] * len(keys)
            try:
                # no decode_responses: Redis returns bytes
                values = list(await self._redis.mget(keys))
                self.breaker.success()
                return values  # type: ignore[return-value]
            except Exception as exc:  # redis.RedisError, timeouts, OSError: degrade, never 5xx
                self._redis_failed(exc)
                return [None] * len(keys)
        if self._lru is not None:
            return [self._lru.get(k) for k in keys]
        return [None] * len(keys)

    async def _set_many(self, items: dict[str, bytes], ttl: int) -> None:
        if not items:
            return
        if self._redis is not None:
            if not self._redis_usable():
                return
            try:
                async with self._redis.pipeline(transaction=False) as pipe:
                    for k, v in items.items():
                        pipe.set(k, v, ex=ttl)
                    await pipe.execute()
                self.breaker.success()
            except Exception as exc:
                self._redis_failed(exc)
            return
        if self._lru is not None:
            self._lru.update(items)

    # -- embeddings ----------------------------------------------------------------------------
    # keyed by the token ids' fingerprint (``BundleTokenizer.fingerprints``), not the text: texts share a
    # vector exactly when the model gets the same input
    @staticmethod
    def _emb_key(model_id: str, fingerprint: str) -> str:
        return f"paraseek:emb:{model_id}:{fingerprint}"

    async def get_embeddings(self, model_id: str, fingerprints: list[str], dim: int) -> list[np.ndarray | None]:
        """The cached vectors, None where missing or not ``dim`` float32 values (written by another model
        under a colliding key, or cut short): a miss, never a wrong-sized vector."""
        if self.backend == "off":
            return [None] * len(fingerprints)
        raw = await self._get_many([self._emb_key(model_id, f) for f in fingerprints])
        out = [np.frombuffer(r, dtype=np.float32) if r is not None and len(r) == 4 * dim else None for r in raw]
        for r in out:
            self.metrics.cache.labels("embedding", "hit" if r is not None else "miss").inc()
        return out

    async def put_embeddings(self, model_id: str, fingerprints: list[str], vectors: np.ndarray) -> None:
        await self._set_many(
            {self._emb_key(model_id, f): np.asarray(v, np.float32).tobytes() for f, v in zip(fingerprints, vectors)},
            self.embedding_ttl_s,
        )

    # -- results -------------------------------------------------------------------------------
    async def get_result(self, key: str) -> dict | None:
        if self.backend == "off":
            return None
        (raw,) = await self._get_many([f"paraseek:res:{key}"])
        self.metrics.cache.labels("result", "hit" if raw is not None else "miss").inc()
        return orjson.loads(raw) if raw is not None else None

    async def put_result(self, key: str, value: dict) -> None:
        if self.backend != "off":  # serialising a response costs more than the rest of a cache hit
            await self._set_many({f"paraseek:res:{key}": orjson.dumps(value)}, self.result_ttl_s)

    async def close(self) -> None:
        if self._redis is not None:
            try:
                await self._redis.aclose()
            except Exception:
                pass
