"""Query-embedding and result caches: Redis when configured, else an in-process LRU.

Redis errors or timeouts never fail a request: the lookup counts as a miss, a warning is logged, a
metric counts it, and Redis is skipped for ``retry_after_s`` so a dead server adds no latency.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time

import numpy as np
from cachetools import LRUCache

log = logging.getLogger(__name__)


def text_key(text: str) -> str:
    """Normalised text: case and whitespace do not change an embedding lookup."""
    return hashlib.sha1(" ".join(text.lower().split()).encode()).hexdigest()


def params_key(params: dict) -> str:
    return hashlib.sha1(json.dumps(params, sort_keys=True, default=str).encode()).hexdigest()


class Cache:
    def __init__(self, metrics, redis_url: str | None = None, *, timeout_s: float = 0.25, retry_after_s: float = 5.0,
                 embedding_ttl_s: int = 604800, result_ttl_s: int = 600, lru_size: int = 10_000):
        self.metrics = metrics
        self.embedding_ttl_s = embedding_ttl_s
        self.result_ttl_s = result_ttl_s
        self.retry_after_s = retry_after_s
        self._down_until = 0.0
        self._redis = None
        self._lru: LRUCache[str, bytes] | None = LRUCache(maxsize=max(lru_size, 1)) if lru_size else None
        if redis_url:
            import redis.asyncio as redis

            self._redis = redis.from_url(redis_url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s,
                                         retry_on_timeout=False)
        self.backend = "redis" if self._redis else ("lru" if self._lru is not None else "off")

    # -- backend primitives ------------------------------------------------------------------
    def _redis_usable(self) -> bool:
        return self._redis is not None and time.monotonic() >= self._down_until

    def _redis_failed(self, exc: Exception) -> None:
        self.metrics.cache_errors.inc()
        self._down_until = time.monotonic() + self.retry_after_s
        log.warning("redis unavailable, serving without cache for %.0fs: %s", self.retry_after_s, exc)

    async def _get_many(self, keys: list[str]) -> list[bytes | None]:
        if self._redis is not None:
            if not self._redis_usable():
                return [None] * len(keys)
            try:
                # no decode_responses: Redis returns bytes
                return list(await self._redis.mget(keys))  # type: ignore[arg-type]
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
            except Exception as exc:
                self._redis_failed(exc)
            return
        if self._lru is not None:
            self._lru.update(items)

    # -- embeddings ----------------------------------------------------------------------------
    @staticmethod
    def _emb_key(model_id: str, text: str) -> str:
        return f"paraseek:emb:{model_id}:{text_key(text)}"

    async def get_embeddings(self, model_id: str, texts: list[str]) -> list[np.ndarray | None]:
        raw = await self._get_many([self._emb_key(model_id, t) for t in texts])
        out = [np.frombuffer(r, dtype=np.float32) if r is not None else None for r in raw]
        for r in out:
            self.metrics.cache.labels("embedding", "hit" if r is not None else "miss").inc()
        return out

    async def put_embeddings(self, model_id: str, texts: list[str], vectors: np.ndarray) -> None:
        await self._set_many(
            {self._emb_key(model_id, t): np.asarray(v, np.float32).tobytes() for t, v in zip(texts, vectors)},
            self.embedding_ttl_s,
        )

    # -- results -------------------------------------------------------------------------------
    async def get_result(self, key: str) -> dict | None:
        (raw,) = await self._get_many([f"paraseek:res:{key}"])
        self.metrics.cache.labels("result", "hit" if raw is not None else "miss").inc()
        return json.loads(raw) if raw is not None else None

    async def put_result(self, key: str, value: dict) -> None:
        await self._set_many({f"paraseek:res:{key}": json.dumps(value).encode()}, self.result_ttl_s)

    async def close(self) -> None:
        if self._redis is not None:
            try:
                await self._redis.aclose()
            except Exception:
                pass
