"""The cache's circuit breaker, and the cache against a real redis-server that is slowed, killed
and restarted."""

from __future__ import annotations

import asyncio
import threading
import time

import numpy as np
import pytest

from paraseek.service.cache import Cache, CircuitBreaker, params_key
from paraseek.service.prometheus import ServiceMetrics

pytestmark = pytest.mark.quick


class FakeClock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_breaker_needs_consecutive_failures_and_probes_once():
    clock = FakeClock()
    b = CircuitBreaker(failures_to_open=3, open_s=5.0, clock=clock)
    assert not b.failure() and not b.failure() and b.allow()  # two slow calls: still closed
    b.success()
    assert not b.failure() and not b.failure() and b.allow()  # a success reset the count
    assert b.failure() and b.state == "open" and not b.allow()
    clock.now += 4.9
    assert not b.allow()
    clock.now += 0.2
    assert b.allow() and b.state == "half-open"
    assert not b.allow()  # only one probe at a time
    assert b.failure() and b.state == "open"  # a failed probe opens it again
    clock.now += 5
    assert b.allow()
    b.success()
    assert b.state == "closed" and b.allow() and b.allow()


def test_breaker_opens_at_once_on_a_refused_connection():
    b = CircuitBreaker(failures_to_open=3, open_s=1.0, clock=FakeClock())
    assert b.failure(refused=True) and b.state == "open"


def test_params_key_ignores_key_order_and_tells_values_apart():
    a = {"request": {"query": "a dog", "k": 5, "filter": {"year": [2014, 2017]}}, "snapshot": "v1"}
    b = {"snapshot": "v1", "request": {"filter": {"year": [2014, 2017]}, "k": 5, "query": "a dog"}}
    assert params_key(a) == params_key(b)
    assert params_key(a) != params_key({**a, "snapshot": "v2"})
    assert params_key({1: "x"}) != params_key({2: "x"})  # non-string keys (ids) are allowed


def test_results_and_embeddings_round_trip_in_the_lru_and_an_off_cache_keeps_nothing():
    async def scenario(lru_size: int):
        cache = Cache(ServiceMetrics(), lru_size=lru_size)
        await cache.put_result("k", {"results": [{"id": 1, "score": 0.5}], "cache": "miss"})
        # embeddings are keyed by their token ids' fingerprint (tests/core/test_tokenizer.py: which texts share one)
        await cache.put_embeddings("m", ["fingerprint-of-a-dog"], np.ones((1, 3), np.float32))
        return cache.backend, await cache.get_result("k"), await cache.get_embeddings("m", ["fingerprint-of-a-dog", "of-a-cat"], 3)

    backend, result, (dog, cat) = asyncio.run(scenario(10))
    assert backend == "lru" and result == {"results": [{"id": 1, "score": 0.5}], "cache": "miss"}
    assert dog is not None and dog.tolist() == [1.0, 1.0, 1.0] and cat is None
    assert asyncio.run(scenario(0)) == ("off", None, [None, None])


def test_a_cached_vector_of_another_width_is_a_miss():
    async def scenario():
        cache = Cache(ServiceMetrics(), lru_size=10)
        await cache.put_embeddings("m", ["fp"], np.ones((1, 3), np.float32))
        return await cache.get_embeddings("m", ["fp"], 4), await cache.get_embeddings("m", ["fp"], 3)

    wider, same = asyncio.run(scenario())
    assert wider == [None] and same[0] is not None and same[0].shape == (3,)


def _errors(metrics: ServiceMetrics) -> float:
    return sum(s.value for m in metrics.cache_errors.collect() for s in m.samples if s.name.endswith("_total"))


def test_one_slow_call_does_not_switch_the_cache_off(redis_server):
    import redis

    async def scenario():
        metrics = ServiceMetrics()
        cache = Cache(metrics, redis_server["url"], timeout_s=0.2, retry_after_s=30)
        await cache.put_result("k", {"v": 1})
        assert await cache.get_result("k") == {"v": 1}
        other = redis.Redis.from_url(redis_server["url"])
        blocker = threading.Thread(target=lambda: other.execute_command("DEBUG", "SLEEP", "0.5"))
        blocker.start()
        await asyncio.sleep(0.05)
        assert await cache.get_result("k") is None  # timed out: a miss, never an error
        blocker.join()
        assert _errors(metrics) == 1 and cache.breaker.state == "closed"
        assert await cache.get_result("k") == {"v": 1}  # the very next call uses Redis again
        await cache.close()

    asyncio.run(scenario())


def test_a_redis_restart_costs_no_cacheless_pause(redis_server):
    async def scenario():
        metrics = ServiceMetrics()
        cache = Cache(metrics, redis_server["url"], timeout_s=0.5, retry_after_s=30)
        await cache.put_result("before", {"v": 1})
        assert await cache.get_result("before") == {"v": 1}  # the pool now holds a connection
        await asyncio.to_thread(redis_server["restart"])
        # the pooled connection died with the old server: the command is retried on a fresh one
        await cache.put_result("after", {"v": 2})
        assert await cache.get_result("after") == {"v": 2}
        assert _errors(metrics) == 0 and cache.breaker.state == "closed"
        await cache.close()

    asyncio.run(scenario())


def test_dead_redis_is_skipped_then_probed(redis_server):
    async def scenario():
        metrics = ServiceMetrics()
        cache = Cache(metrics, redis_server["url"], timeout_s=0.2, retry_after_s=0.3)
        redis_server["proc"].kill()
        redis_server["proc"].wait()
        t0 = time.perf_counter()
        assert await cache.get_result("x") is None
        assert cache.breaker.state == "open"
        for _ in range(20):  # skipped without waiting on the network
            assert await cache.get_result("x") is None
        assert time.perf_counter() - t0 < 1.0 and _errors(metrics) == 1
        await asyncio.to_thread(redis_server["restart"])
        await asyncio.sleep(0.35)
        await cache.put_result("x", {"v": 3})  # the probe succeeds and closes the breaker
        assert cache.breaker.state == "closed" and await cache.get_result("x") == {"v": 3}
        await cache.close()

    asyncio.run(scenario())
