"""The builder's decode pipeline: photos are decoded in parallel, in order, a bounded distance ahead."""

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from paraseek.index.builder import decoded_ahead

pytestmark = pytest.mark.quick


def test_decoded_ahead_keeps_order_and_computes_at_most_the_window_ahead():
    started: list[int] = []
    lock = threading.Lock()

    def decode(i: int) -> int:
        with lock:
            started.append(i)
        time.sleep(0.002 * (i % 3))  # later items often finish first
        return i * i

    with ThreadPoolExecutor(max_workers=4) as pool:
        results = []
        for consumed, (item, value) in enumerate(decoded_ahead(pool, decode, range(50), window=5), 1):
            time.sleep(0.001)  # a consumer slower than the decoders
            with lock:
                assert len(started) <= consumed + 5  # never more than the window beyond what was taken
            results.append((item, value))
    assert results == [(i, i * i) for i in range(50)]
    assert sorted(started) == list(range(50))


def test_decoded_ahead_of_nothing_and_of_fewer_items_than_the_window():
    with ThreadPoolExecutor(max_workers=2) as pool:
        assert list(decoded_ahead(pool, str, [], window=4)) == []
        assert list(decoded_ahead(pool, str, [1, 2], window=4)) == [(1, "1"), (2, "2")]
