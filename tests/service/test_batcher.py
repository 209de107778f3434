"""The micro-batcher on its own, with a fake encoder that records its calls."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from service.batcher import MicroBatcher


class FakeEncoder:
    def __init__(self, bad: str | None = None):
        self.calls: list[list[str]] = []
        self.bad = bad

    def __call__(self, model, texts: list[str]):
        self.calls.append(list(texts))
        if self.bad is not None and self.bad in texts:
            raise ValueError(f"cannot encode {self.bad!r}")
        return np.array([[float(len(t)), float(model)] for t in texts], np.float32), [t.endswith("!") for t in texts]


async def _submit_all(batcher: MicroBatcher, requests: list[tuple[int, list[str]]]):
    await batcher.start()
    try:
        return await asyncio.gather(*(batcher.submit(m, t) for m, t in requests), return_exceptions=True)
    finally:
        await batcher.stop()


def test_concurrent_requests_share_one_call_and_get_their_own_rows():
    enc = FakeEncoder()
    batcher = MicroBatcher(enc, max_batch_size=64, max_wait_ms=20)
    requests = [(1, ["a", "bb"]), (1, ["ccc!"]), (1, ["dddd", "e", "ff"])]
    results = asyncio.run(_submit_all(batcher, requests))
    assert len(enc.calls) == 1 and enc.calls[0] == ["a", "bb", "ccc!", "dddd", "e", "ff"]
    for (_, texts), (vectors, truncated) in zip(requests, results):
        assert vectors[:, 0].tolist() == [len(t) for t in texts]
        assert truncated == [t.endswith("!") for t in texts]


def test_models_never_mix_in_one_call():
    enc = FakeEncoder()
    results = asyncio.run(_submit_all(MicroBatcher(enc, max_wait_ms=20), [(1, ["a"]), (2, ["b"]), (1, ["c"])]))
    assert [r[0][0, 1] for r in results] == [1.0, 2.0, 1.0]  # each row came from its own model
    # consecutive requests of one model may share a call; a call never holds two models' texts
    assert sorted(t for call in enc.calls for t in call) == ["a", "b", "c"]
    assert ["b"] in enc.calls


def test_a_failing_text_fails_only_its_own_request():
    enc = FakeEncoder(bad="poison")
    results = asyncio.run(_submit_all(MicroBatcher(enc, max_wait_ms=20), [(1, ["ok"]), (1, ["poison"]), (1, ["fine", "x"])]))
    assert isinstance(results[1], ValueError) and "poison" in str(results[1])
    assert results[0][0][:, 0].tolist() == [2.0]
    assert results[2][0][:, 0].tolist() == [4.0, 1.0]
    # one merged call failed, then each request was retried on its own
    assert enc.calls[0] == ["ok", "poison", "fine", "x"] and enc.calls[1:] == [["ok"], ["poison"], ["fine", "x"]]


def test_batching_off_encodes_each_request_by_itself():
    enc = FakeEncoder()
    sizes: list[int] = []
    batcher = MicroBatcher(enc, enabled=False, on_batch=sizes.append)
    results = asyncio.run(_submit_all(batcher, [(1, ["a", "b"]), (1, ["c"])]))
    assert sorted(map(tuple, enc.calls)) == [("a", "b"), ("c",)]
    assert sorted(sizes) == [1, 2]
    assert results[0][0][:, 0].tolist() == [1.0, 1.0]


def test_batch_size_cap_splits_calls():
    enc = FakeEncoder()
    results = asyncio.run(_submit_all(MicroBatcher(enc, max_batch_size=3, max_wait_ms=20), [(1, ["a", "b"])] * 4))
    assert all(len(call) <= 4 for call in enc.calls) and len(enc.calls) >= 2
    assert all(r[0].shape == (2, 2) for r in results)


@pytest.mark.parametrize("n", [1, 5])
def test_results_keep_request_order(n):
    enc = FakeEncoder()
    texts = [["x" * (i + 1)] for i in range(n)]
    results = asyncio.run(_submit_all(MicroBatcher(enc, max_wait_ms=5), [(1, t) for t in texts]))
    assert [r[0][0, 0] for r in results] == [float(i + 1) for i in range(n)]
