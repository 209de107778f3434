"""The continuous batcher on its own, with fake encoders and indexes that record their calls."""

from __future__ import annotations

import asyncio
import threading
from types import SimpleNamespace

import numpy as np
import pytest

from paraseek.service.batcher import ContinuousBatcher, LoneCallGate, RecentPeak, encode_texts, search_rows


pytestmark = pytest.mark.quick


class FakeEncoder:
    def __init__(self, bad: str | None = None, gate: threading.Event | None = None):
        self.calls: list[list[str]] = []
        self.bad = bad
        self.gate = gate  # the first call waits on it, so the test controls what arrives meanwhile
        self.started = threading.Event()

    def __call__(self, model, texts: list[str]):
        self.calls.append(list(texts))
        self.started.set()
        if self.gate is not None and len(self.calls) == 1:
            self.gate.wait(10)
        if self.bad is not None and self.bad in texts:
            raise ValueError(f"cannot encode {self.bad!r}")
        return np.array([[float(len(t)), float(model)] for t in texts], np.float32), [t.endswith("!") for t in texts]


def _encoder_batcher(enc, **kw) -> ContinuousBatcher:
    return ContinuousBatcher(encode_texts(enc), name="test-encoder", size=len, **kw)


async def _submit_all(batcher: ContinuousBatcher, requests: list[tuple[int, list[str]]]):
    await batcher.start()
    try:
        return await asyncio.gather(*(batcher.submit(m, t) for m, t in requests), return_exceptions=True)
    finally:
        await batcher.stop()


def test_concurrent_requests_share_one_call_and_get_their_own_rows():
    enc = FakeEncoder()
    requests = [(1, ["a", "bb"]), (1, ["ccc!"]), (1, ["dddd", "e", "ff"])]
    results = asyncio.run(_submit_all(_encoder_batcher(enc), requests))
    assert len(enc.calls) == 1 and enc.calls[0] == ["a", "bb", "ccc!", "dddd", "e", "ff"]
    for (_, texts), (vectors, truncated) in zip(requests, results):
        assert vectors[:, 0].tolist() == [len(t) for t in texts]
        assert truncated == [t.endswith("!") for t in texts]


def test_idle_encoder_dispatches_at_once_and_a_busy_one_gathers_the_next_batch():
    """No fixed wait: the first request goes alone; what arrives while it runs forms the next call."""
    gate = threading.Event()
    enc = FakeEncoder(gate=gate)
    batcher = _encoder_batcher(enc, max_wait_ms=0)

    async def go():
        await batcher.start()
        try:
            first = asyncio.create_task(batcher.submit(1, ["first"]))
            await asyncio.to_thread(enc.started.wait, 10)  # the encoder took "first" without waiting for company
            later = [asyncio.create_task(batcher.submit(1, [f"later{i}"])) for i in range(5)]
            await asyncio.sleep(0.05)
            gate.set()
            return await asyncio.gather(first, *later)
        finally:
            await batcher.stop()

    results = asyncio.run(go())
    assert enc.calls == [["first"], [f"later{i}" for i in range(5)]]
    assert [r[0][0, 0] for r in results] == [5.0] + [6.0] * 5


def test_models_never_mix_in_one_call():
    enc = FakeEncoder()
    results = asyncio.run(_submit_all(_encoder_batcher(enc), [(1, ["a"]), (2, ["b"]), (1, ["c"])]))
    assert [r[0][0, 1] for r in results] == [1.0, 2.0, 1.0]  # each row came from its own model
    assert sorted(enc.calls) == [["a", "c"], ["b"]]


def test_a_failing_text_fails_only_its_own_request():
    enc = FakeEncoder(bad="poison")
    results = asyncio.run(_submit_all(_encoder_batcher(enc), [(1, ["ok"]), (1, ["poison"]), (1, ["fine", "x"])]))
    assert isinstance(results[1], ValueError) and "poison" in str(results[1])
    assert results[0][0][:, 0].tolist() == [2.0]
    assert results[2][0][:, 0].tolist() == [4.0, 1.0]
    # one merged call failed, then each request was retried on its own
    assert enc.calls[0] == ["ok", "poison", "fine", "x"] and enc.calls[1:] == [["ok"], ["poison"], ["fine", "x"]]


def test_batching_off_runs_each_request_by_itself():
    enc = FakeEncoder()
    sizes: list[int] = []
    batcher = _encoder_batcher(enc, enabled=False, on_batch=sizes.append)
    results = asyncio.run(_submit_all(batcher, [(1, ["a", "b"]), (1, ["c"])]))
    assert sorted(map(tuple, enc.calls)) == [("a", "b"), ("c",)]
    assert sorted(sizes) == [1, 2]
    assert results[0][0][:, 0].tolist() == [1.0, 1.0]


def test_batch_size_cap_splits_calls():
    enc = FakeEncoder()
    results = asyncio.run(_submit_all(_encoder_batcher(enc, max_batch_size=3), [(1, ["a", "b"])] * 4))
    assert all(len(call) <= 4 for call in enc.calls) and len(enc.calls) >= 2
    assert all(r[0].shape == (2, 2) for r in results)


@pytest.mark.parametrize("n", [1, 5])
def test_results_keep_request_order(n):
    enc = FakeEncoder()
    texts = [["x" * (i + 1)] for i in range(n)]
    results = asyncio.run(_submit_all(_encoder_batcher(enc), [(1, t) for t in texts]))
    assert [r[0][0, 0] for r in results] == [float(i + 1) for i in range(n)]


class FakeIndex:
    """Scores are -|query - id| over ids 0..99, so each row's ranking is known."""

    def __init__(self):
        self.calls: list[tuple[int, int]] = []

    def __call__(self, name, queries: np.ndarray, k: int):
        self.calls.append((len(queries), k))
        ids = np.arange(100)
        scores = -np.abs(queries[:, :1] - ids[None, :])
        order = np.argsort(-scores, axis=1, kind="stable")[:, :k]
        return np.take_along_axis(scores, order, axis=1), order + (1000 if name == "v2" else 0)


def test_index_searches_merge_across_k_and_never_across_snapshots():
    index = FakeIndex()
    batcher = ContinuousBatcher(search_rows(index), name="test-index", size=lambda p: len(p[0]))
    requests = [("v1", (np.array([[10.0], [50.0]]), 3)), ("v1", (np.array([[20.0]]), 7)), ("v2", (np.array([[5.0]]), 2))]

    async def go():
        await batcher.start()
        try:
            return await asyncio.gather(*(batcher.submit(key, payload) for key, payload in requests))
        finally:
            await batcher.stop()

    results = asyncio.run(go())
    assert sorted(index.calls) == [(1, 2), (3, 7)]  # v1's three rows in one call at the larger k; v2 alone
    (s1, i1), (s2, i2), (s3, i3) = results
    assert i1.shape == (2, 3) and i1[:, 0].tolist() == [10, 50]
    assert i2.shape == (1, 7) and i2[0, 0] == 20
    assert i3.tolist() == [[1005, 1004]] or i3.tolist() == [[1005, 1006]]
    assert (s1[:, 0] == 0).all() and s2[0, 0] == 0


def _index_batcher(index, **kw) -> ContinuousBatcher:
    return ContinuousBatcher(search_rows(index), name="test-index", size=lambda p: len(p[0]), **kw)


def test_index_waits_for_announced_requests_and_searches_them_together():
    """A request still being encoded is announced: the search that would start alone waits for its rows
    (one scan for both), and nothing waits when nothing is announced."""
    index = FakeIndex()
    batcher = _index_batcher(index, max_expect_wait_ms=5_000)

    async def go():
        await batcher.start()
        try:
            alone = await asyncio.wait_for(batcher.submit("v1", (np.array([[1.0]]), 3)), 2)  # nothing announced
            with batcher.expect() as on_its_way:
                first = asyncio.create_task(batcher.submit("v1", (np.array([[10.0]]), 3)))
                await asyncio.sleep(0.1)  # the worker holds "first" for the announced request
                assert not first.done() and len(index.calls) == 1
                second = await batcher.submit("v1", (np.array([[20.0]]), 3), expected=on_its_way)
            return alone, await first, second
        finally:
            await batcher.stop()

    alone, first, second = asyncio.run(go())
    assert index.calls == [(1, 3), (2, 3)]  # the announced request joined the waiting one's search
    assert alone[1][0, 0] == 1 and first[1][0, 0] == 10 and second[1][0, 0] == 20


def test_a_request_that_fails_before_arriving_stops_the_wait_at_once():
    index = FakeIndex()
    batcher = _index_batcher(index, max_expect_wait_ms=5_000)

    async def go():
        await batcher.start()
        try:
            loop = asyncio.get_running_loop()
            with pytest.raises(RuntimeError):
                with batcher.expect():
                    waiting = asyncio.create_task(batcher.submit("v1", (np.array([[10.0]]), 3)))
                    await asyncio.sleep(0.05)
                    assert not waiting.done()
                    t0 = loop.time()
                    raise RuntimeError("the encoder failed for the announced request")
            result = await asyncio.wait_for(waiting, 2)
            return result, loop.time() - t0
        finally:
            await batcher.stop()

    (scores, ids), waited = asyncio.run(go())
    assert ids[0, 0] == 10 and waited < 1.0  # released, not timed out after 5 s
    assert index.calls == [(1, 3)]


def test_the_wait_for_announced_requests_is_bounded():
    index = FakeIndex()
    batcher = _index_batcher(index, max_expect_wait_ms=50)

    async def go():
        await batcher.start()
        try:
            loop = asyncio.get_running_loop()
            with batcher.expect():  # announced, never arrives within the bound
                t0 = loop.time()
                result = await asyncio.wait_for(batcher.submit("v1", (np.array([[10.0]]), 3)), 2)
                return result, loop.time() - t0
        finally:
            await batcher.stop()

    (scores, ids), waited = asyncio.run(go())
    assert ids[0, 0] == 10 and index.calls == [(1, 3)]
    assert 0.04 <= waited < 1.0  # it waited for company, then went ahead without it


def test_workers_run_calls_side_by_side_and_share_what_waits():
    """Two workers: while one call is held, the other worker takes requests at once; what waits is
    shared out among the idle workers, so no call takes everything."""
    release = threading.Event()
    running: list[int] = []
    peak = [0]
    lock = threading.Lock()

    def encode(model, texts):
        with lock:
            running.append(1)
            peak[0] = max(peak[0], len(running))
        release.wait(10)
        with lock:
            running.pop()
        return np.array([[float(len(t)), float(model)] for t in texts], np.float32), [False] * len(texts)

    calls: list[int] = []
    batcher = _encoder_batcher(encode, workers=2, on_batch=calls.append)

    async def go():
        await batcher.start()
        try:
            first = [asyncio.create_task(batcher.submit(1, [f"t{i}"])) for i in range(2)]
            await until(lambda: peak[0] == 2)  # both workers hold a call
            release.set()
            done = await asyncio.gather(*first)  # both workers idle again
            later = await asyncio.gather(*(batcher.submit(1, [f"u{i}"]) for i in range(12)))
            return done + later
        finally:
            await batcher.stop()

    results = asyncio.run(go())
    assert peak[0] == 2  # two calls at once
    assert calls[:2] == [1, 1]  # each worker took one of the two waiting requests
    assert calls[2:] == [6, 6]  # the twelve that waited were shared by the two idle workers
    assert [r[0][0, 0] for r in results] == [2.0] * 2 + [2.0] * 10 + [3.0] * 2


async def until(condition, timeout_s: float = 10.0) -> None:
    """Wait (polling) until ``condition()`` holds: what a test waits for, not a guess of how long it takes."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, "timed out waiting"
        await asyncio.sleep(0.005)


def _held_encoder(release: threading.Event):
    """An encoder whose calls all wait for ``release``: the test decides when calls end."""
    def encode(model, texts):
        release.wait(10)
        return np.array([[float(len(t)), float(model)] for t in texts], np.float32), [False] * len(texts)
    return encode


def _loaded_batcher(release: threading.Event, calls: list[int], wait_ms: float, coming=None) -> ContinuousBatcher:
    """Two workers at a steady load of 8 requests."""
    return _encoder_batcher(_held_encoder(release), workers=2, on_batch=calls.append, load=lambda: 8,
                            max_company_wait_ms=wait_ms, coming=coming)


def test_under_steady_load_a_batch_waits_for_its_share_of_the_load():
    """Load 8 on two workers: while one worker's call of 4 runs, the other does not go with the one
    request that arrived first; it waits (bounded) for the others of its share, which arrive one by
    one as a closed loop of clients sends them, and runs them in one call of 4."""
    release = threading.Event()
    calls: list[int] = []
    batcher = _loaded_batcher(release, calls, 1000)

    async def go():
        await batcher.start()
        try:
            running = [asyncio.create_task(batcher.submit(1, [f"r{i}"])) for i in range(4)]
            await asyncio.sleep(0.05)  # one worker holds a call of 4 (its share of 8 on 2 workers)
            arriving = []
            for i in range(4):  # the rest of the load arrives one by one
                arriving.append(asyncio.create_task(batcher.submit(1, [f"a{i}"])))
                await asyncio.sleep(0.02)
            release.set()
            return await asyncio.gather(*running, *arriving)
        finally:
            await batcher.stop()

    results = asyncio.run(go())
    assert calls == [4, 4]
    assert len(results) == 8


def test_the_wait_for_the_loads_share_is_bounded_and_skipped_when_no_call_runs():
    release = threading.Event()
    release.set()
    calls: list[int] = []
    batcher = _loaded_batcher(release, calls, 5000)

    async def go():
        await batcher.start()
        try:
            started = asyncio.get_running_loop().time()
            await batcher.submit(1, ["alone"])  # nothing else runs: the cores are free, it goes at once
            return asyncio.get_running_loop().time() - started
        finally:
            await batcher.stop()

    assert asyncio.run(go()) < 1.0 and calls == [1]

    hold = threading.Event()
    calls.clear()
    batcher = _loaded_batcher(hold, calls, 200)

    async def bounded():
        await batcher.start()
        try:
            running = [asyncio.create_task(batcher.submit(1, [f"r{i}"])) for i in range(4)]
            await asyncio.sleep(0.05)
            started = asyncio.get_running_loop().time()
            waiting = asyncio.create_task(batcher.submit(1, ["only"]))
            while not calls[1:]:  # the second worker's call starts after its bounded wait
                await asyncio.sleep(0.01)
            waited = asyncio.get_running_loop().time() - started
            hold.set()
            await asyncio.gather(*running, waiting)
            return waited
        finally:
            await batcher.stop()

    waited = asyncio.run(bounded())
    assert 0.15 <= waited < 2.0 and calls == [4, 1]


def test_no_wait_for_company_that_cannot_come():
    """Load 8, a call of 4 running, one request left: where ``coming`` says the rest of the load cannot
    arrive (each of its requests is queued, in a call or past the encoder: the last texts of a wave),
    the second worker runs that one at once instead of waiting out the bound; while it says some may
    come, it waits."""
    async def second_call_after(coming_now: int) -> float:
        hold = threading.Event()
        calls: list[int] = []
        asked: list[int] = []

        def coming() -> int:
            asked.append(coming_now)
            return coming_now

        batcher = _loaded_batcher(hold, calls, 400, coming=coming)
        await batcher.start()
        try:
            running = [asyncio.create_task(batcher.submit(1, [f"r{i}"])) for i in range(4)]
            await asyncio.sleep(0.05)
            started = asyncio.get_running_loop().time()
            last = asyncio.create_task(batcher.submit(1, ["last"]))
            while not calls[1:]:
                await asyncio.sleep(0.005)
            waited = asyncio.get_running_loop().time() - started
            hold.set()
            await asyncio.gather(*running, last)
            assert calls == [4, 1] and asked  # asked while the first call ran
            return waited
        finally:
            await batcher.stop()

    assert asyncio.run(second_call_after(0)) < 0.2
    assert 0.35 <= asyncio.run(second_call_after(3)) < 2.0


def test_pending_counts_what_is_queued_and_what_a_call_holds():
    release = threading.Event()
    batcher = _encoder_batcher(_held_encoder(release), max_batch_size=2)

    async def go():
        await batcher.start()
        try:
            tasks = [asyncio.create_task(batcher.submit(1, [f"t{i}"])) for i in range(5)]
            await asyncio.sleep(0.05)  # one call holds 2, 3 wait
            held = batcher.pending
            release.set()
            await asyncio.gather(*tasks)
            return held, batcher.pending
        finally:
            await batcher.stop()

    assert asyncio.run(go()) == (5, 0)


def test_recent_peak_remembers_the_load_for_one_to_two_windows():
    now = [0.0]
    peak = RecentPeak(window_s=1.0, clock=lambda: now[0])
    for value in (3, 8, 2):
        peak.observe(value)
    assert peak() == 8
    now[0] = 1.5  # one window later: still the previous window's peak
    peak.observe(1)
    assert peak() == 8
    now[0] = 2.6  # the window that saw 8 is gone
    assert peak() == 1
    now[0] = 10.0  # long idle: nothing recent
    assert peak() == 0


def test_a_batcher_is_busy_while_a_call_runs_on_its_thread_even_after_its_request_gave_up():
    """``idle`` counts calls on the batcher's threads, not requests waiting for them: a request that
    timed out leaves its call running (a thread cannot be stopped), and the cores stay taken until it
    returns. Batched, unbatched and ``run_alone`` calls alike."""
    started, release = threading.Event(), threading.Event()

    def slow(_key, payloads):
        started.set()
        release.wait(10)
        return payloads

    async def scenario(batcher: ContinuousBatcher, call):
        await batcher.start()
        assert batcher.idle
        task = asyncio.create_task(call(batcher))
        assert await asyncio.to_thread(started.wait, 10)
        assert not batcher.idle
        task.cancel()  # the request gives up; its call does not
        with pytest.raises(asyncio.CancelledError):
            await task
        await asyncio.sleep(0.05)
        busy_after_cancel = not batcher.idle
        release.set()
        for _ in range(200):
            if batcher.idle:
                break
            await asyncio.sleep(0.01)
        await batcher.stop()
        return busy_after_cancel, batcher.idle

    calls = {
        "batched": (True, lambda b: b.submit("k", 1)),
        "unbatched": (False, lambda b: b.submit("k", 1)),
        "alone": (True, lambda b: b.run_alone(slow, "k", [1])),
    }
    for name, (enabled, call) in calls.items():
        started.clear()
        release.clear()
        assert asyncio.run(scenario(ContinuousBatcher(slow, name="t", enabled=enabled), call)) == (True, True), name


def test_a_call_cancelled_before_its_thread_starts_it_leaves_the_batcher_idle():
    """A queued thread call that is cancelled never runs: it must not count as running forever."""
    release = threading.Event()

    async def scenario():
        batcher = ContinuousBatcher(lambda key, payloads: payloads, name="t")  # one thread
        await batcher.start()
        first = asyncio.create_task(batcher.run_alone(release.wait, 10))
        second = asyncio.create_task(batcher.run_alone(lambda: None))  # queued behind the first
        await asyncio.sleep(0.05)
        second.cancel()
        await asyncio.sleep(0.05)
        release.set()
        await first
        for _ in range(200):
            if batcher.idle:
                break
            await asyncio.sleep(0.01)
        idle = batcher.idle
        await batcher.stop()
        return idle

    assert asyncio.run(scenario())


def test_a_lone_call_runs_alone_and_calls_that_start_during_it_wait_for_it():
    gate = LoneCallGate()
    with gate.call() as lone:
        assert lone  # nothing else runs: it may use every core
    with gate.call(may_run_alone=False) as lone:
        assert not lone  # a call too large to go alone never does

    in_lone, release = threading.Event(), threading.Event()
    order: list[str] = []

    def lone_call():
        with gate.call() as lone:
            order.append(f"lone {lone}")
            in_lone.set()
            release.wait(10)
            order.append("lone ends")

    def other_call():
        with gate.call() as lone:
            order.append(f"other {lone}")

    first = threading.Thread(target=lone_call)
    first.start()
    assert in_lone.wait(10)
    second = threading.Thread(target=other_call)
    second.start()
    second.join(0.2)
    assert second.is_alive()  # held while the lone call has the cores
    release.set()
    first.join(10)
    second.join(10)
    assert order == ["lone True", "lone ends", "other True"]


def test_a_call_that_starts_beside_another_runs_on_its_share_without_waiting():
    gate = LoneCallGate()
    with gate.call(may_run_alone=False) as first:  # e.g. a batch of 8: a single-core call
        with gate.call() as second:  # started while another runs: no wait, and not alone
            assert (first, second) == (False, False)
    with gate.call() as again:
        assert again  # nothing runs any more


def test_the_engine_runs_an_encoder_call_alone_only_for_its_only_request(tmp_path):
    """The solo session (every core) serves the service's only request in flight; calls made while
    other requests are being answered, or of many texts, stay on the workers' single-threaded session."""
    from paraseek.core.settings import Settings
    from paraseek.service.engine import SOLO_MAX_TEXTS, SearchEngine
    from paraseek.service.prometheus import ServiceMetrics

    class Recorder:
        has_solo_session = True
        providers = ["CPUExecutionProvider"]

        def __init__(self):
            self.solo: list[bool] = []

        def encode_text_detailed(self, texts, batch_size, solo=False):
            self.solo.append(solo)
            return np.zeros((len(texts), 2), np.float32), [False] * len(texts)

    engine = SearchEngine(Settings(home=tmp_path), ServiceMetrics())
    encoder = Recorder()
    engine.in_flight = 1
    engine._encode(encoder, ["a dog"])
    engine._encode(encoder, ["t"] * (SOLO_MAX_TEXTS + 1))
    engine.in_flight = 2
    engine._encode(encoder, ["a dog"])
    encoder.has_solo_session = False
    engine.in_flight = 1
    engine._encode(encoder, ["a dog"])
    assert encoder.solo == [True, False, False, False]


def test_an_encoder_call_under_load_runs_its_texts_in_short_runs_of_similar_length(tmp_path, starter_bundle):
    """On CPU a call's texts are sorted by token count and run 3 at a time (a run pads to its longest
    text); each request still gets its own text's vector, as one run of all of them gives it."""
    from paraseek.core.settings import Settings
    from paraseek.service.engine import SearchEngine
    from paraseek.service.prometheus import ServiceMetrics
    from paraseek.service.runtime import load_encoder

    # fp32: an int8 tower quantizes each run's activations by their own range, so its vectors move a
    # little with the company a text has (cosine >= 0.995 to the text alone, either way)
    encoder = load_encoder(starter_bundle, Settings(home=tmp_path, precision="fp32"))
    texts = [" ".join(["word"] * n) + f" {i}" for i, n in enumerate([9, 1, 5, 12, 3, 7, 2, 10, 4, 6])]
    runs: list[list[int]] = []
    run_text = encoder._run_text

    def recording(batch, solo=False):
        runs.append([int(n) for n in batch.attention_mask.sum(axis=1)])
        return run_text(batch, solo)

    encoder._run_text = recording
    engine = SearchEngine(Settings(home=tmp_path), ServiceMetrics())
    engine.in_flight = 3  # other requests in flight: the workers' single-threaded session
    vectors, _ = engine._encode(encoder, texts)
    assert [len(r) for r in runs] == [3, 3, 3, 1]
    lengths = [n for r in runs for n in r]
    assert lengths == sorted(lengths)  # shortest first, so each run pads little
    whole, _ = encoder.encode_text_detailed(texts, batch_size=len(texts))
    np.testing.assert_allclose(vectors, whole, atol=1e-5)
    runs.clear()
    engine.in_flight = 1  # the only request: one run on every core
    engine._encode(encoder, texts[:3])
    assert [len(r) for r in runs] == [3]


def test_requests_in_flight_are_counted_until_they_end_or_fail():
    from paraseek.core.settings import Settings
    from paraseek.service.batcher import Overloaded
    from paraseek.service.engine import counted
    from paraseek.service.prometheus import ServiceMetrics

    class Engine:
        in_flight = 0
        encoder_load = RecentPeak()
        recent_in_flight = RecentPeak()
        index_batcher = SimpleNamespace(pending=0)  # requests waiting at the index
        settings = Settings(max_in_flight=1)
        metrics = ServiceMetrics()

        @counted
        async def answer(self):
            return self.in_flight

        @counted
        async def fail(self):
            raise ValueError("bad input")

    engine = Engine()
    assert asyncio.run(engine.answer()) == 1
    assert engine.encoder_load() == 1  # the load the encoder batcher forms its batches for
    # requests waiting at the index are not coming to the encoder: they do not count in its load
    engine.encoder_load, engine.index_batcher.pending = RecentPeak(), 1
    assert asyncio.run(engine.answer()) == 1 and engine.encoder_load() == 0
    assert engine.recent_in_flight() == 1  # but they count as requests in flight (the event-loop path's guard)
    with pytest.raises(ValueError):
        asyncio.run(engine.fail())
    assert engine.in_flight == 0
    engine.in_flight = 1  # the one allowed is taken: the next is refused before it runs
    with pytest.raises(Overloaded, match="1 requests are being answered"):
        asyncio.run(engine.answer())
    assert engine.in_flight == 1
