"""Continuous batching: concurrent requests' work merged into one model or index call.

A request puts ``(key, payload)`` on a batcher's queue and awaits a future. The batcher's worker
takes the first waiting item and, without waiting for company, everything else already queued (up to
``max_batch_size`` units), then runs one call per key on its own thread. While that call runs, new
requests queue up and form the next batch: at low load a request is dispatched at once, under load
batches grow by themselves (infinity's batch handler works the same way). ``max_wait_ms`` adds an
optional wait for company; 0 by default.

``workers`` > 1 runs that many calls at once, each on its own thread, from one queue; a worker takes
its share of what waits (the waiting items over the idle workers), so one call never holds
everything while another worker idles. On CPU a small text tower costs about the same per text at
any batch size, and two single-threaded calls side by side do more than one call on two threads.

Under steady load the requests of a closed loop of clients reach the service one by one (each
client sends its next request when its answer came back), so a worker that frees up finds one or
two waiting and the calls stay small, which costs a CPU encoder up to 1.5x per text. With
``load`` (the number of requests the service held recently, ``RecentPeak``) and
``max_company_wait_ms``, a worker that forms a batch while another call runs waits, bounded, for the
requests of that load not yet in hand or in a call: at concurrency 8 on two workers the calls carry
about 4 texts instead of 2. At low load (no other call running) nothing waits, nor while ``coming``
says that none of the load's requests can still arrive (each is queued, in a call or past this stage:
at concurrency 32 the last texts of a wave of requests).

A stage whose calls cost nearly the same for one row as for many (an exact scan streams the whole
collection either way) should not run a batch of one while more rows are already on their way to it.
``expect()`` announces a request heading for this batcher from an earlier stage; while announced
requests have not arrived (or given up), the worker waits for them to join the batch it is forming,
bounded by ``max_expect_wait_ms``. At low load nothing else is announced: a request goes at once.

The service runs two batchers in a pipeline: texts -> encoder batcher -> index batcher -> results.
Each has its own threads (the encoder's workers, the index's one), so encoder calls and an index
search overlap while the index stays one search at a time. Keys keep incompatible work apart: an encoder never sees another encoder's texts after a
reload, and a search never runs against another snapshot version (or, with filters, another filter).
"""

from __future__ import annotations

import asyncio
import math
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Generic, Iterator, Sequence, TypeVar

import numpy as np

P = TypeVar("P")  # one request's payload
R = TypeVar("R")  # one request's result


class Expected:
    """A request announced to a batcher: ``submit(..., expected=this)`` or ``release()`` ends it."""

    __slots__ = ("_batcher",)

    def __init__(self, batcher: ContinuousBatcher):
        self._batcher: ContinuousBatcher | None = batcher
        batcher._expected += 1

    def arrive(self, batcher: ContinuousBatcher) -> None:
        if self._batcher is batcher:
            self._batcher = None
            batcher._expected -= 1

    def release(self) -> None:
        """No longer on its way (failed, or taking another path first)."""
        batcher, self._batcher = self._batcher, None
        if batcher is not None:
            batcher._expected -= 1
            if batcher._queue is not None and not batcher._queue.full():
                batcher._queue.put_nowait(_WAKE)  # a worker waiting for this request stops waiting

    def __enter__(self) -> Expected:
        return self

    def __exit__(self, *exc) -> None:
        self.release()


_WAKE: Any = object()  # queued by a release: wakes a waiting worker, carries no work


@dataclass
class _Item:
    key: Any
    payload: Any
    run: Callable[[Any, list], list]
    future: asyncio.Future
    queued_at: float = 0.0  # time.monotonic() when submitted


class Overloaded(RuntimeError):
    """The service takes no more work now (-> 503 with Retry-After): requests in flight or a queue at
    its bound. Refusing at once keeps the accepted requests' latency; queueing would raise everyone's."""


class ContinuousBatcher(Generic[P, R]):
    def __init__(self, run: Callable[[Any, list[P]], list[R]], *, name: str, max_batch_size: int = 64,
                 max_wait_ms: float = 0.0, enabled: bool = True, size: Callable[[P], int] = lambda p: 1,
                 on_batch: Callable[[int], None] | None = None, workers: int = 1, max_expect_wait_ms: float = 0.0,
                 max_queued: int = 1024, on_wait: Callable[[float], None] | None = None,
                 load: Callable[[], int] | None = None, max_company_wait_ms: float = 0.0,
                 coming: Callable[[], int] | None = None):
        """``run(key, payloads) -> results`` (one per payload) does one merged call; ``size`` says how
        many units (texts, query rows) a payload holds, for the cap and the metrics; ``workers`` calls
        run at once; announced requests (``expect``) are waited for up to ``max_expect_wait_ms``; past
        ``max_queued`` waiting payloads, ``submit`` raises ``Overloaded``; ``on_wait`` gets each payload's
        seconds in the queue before its call started; ``load() -> requests`` the service holds at the
        current load, whose payloads a batch formed while another call runs waits for, up to
        ``max_company_wait_ms``, while ``coming() -> requests`` of that load may still submit here (default: always)."""
        self.run = run
        self.name = name
        self.max_batch_size = max_batch_size
        self.max_wait = max_wait_ms / 1000.0
        self.enabled = enabled
        self.size = size
        self.on_batch = on_batch
        self.on_wait = on_wait
        self.workers = max(1, workers)
        self.max_expect_wait = max_expect_wait_ms / 1000.0
        self.max_queued = max_queued
        self.load = load
        self.max_company_wait = max_company_wait_ms / 1000.0
        self.coming = coming
        self._executor = ThreadPoolExecutor(max_workers=self.workers, thread_name_prefix=name)
        self._unbatched: ThreadPoolExecutor | None = None  # batching off: every request on its own thread
        self._on_threads = 0  # calls handed to this batcher's threads and not yet finished there
        self._on_threads_lock = threading.Lock()
        self._queue: asyncio.Queue[_Item] | None = None
        self._tasks: list[asyncio.Task] = []
        self._expected = 0  # announced requests not yet submitted
        self._idle = 0  # workers not running a call
        self._running = 0  # payloads in calls now running

    async def start(self) -> None:
        if self.enabled and not self._tasks:
            # one place more than the bound for the wake-ups a release queues
            self._queue = asyncio.Queue(maxsize=self.max_queued + 1)
            self._idle = self.workers
            self._tasks = [asyncio.create_task(self._loop(), name=f"{self.name}-batcher-{i}") for i in range(self.workers)]

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
            try:
                await task
            except asyncio.CancelledError:
                pass
        self._tasks = []
        self._executor.shutdown(wait=False, cancel_futures=True)
        if self._unbatched is not None:
            self._unbatched.shutdown(wait=False, cancel_futures=True)

    @property
    def pending(self) -> int:
        """Payloads queued here or in a running call."""
        return (self._queue.qsize() if self._queue is not None else 0) + self._running

    def expect(self) -> Expected:
        """Announce a request that will ``submit`` here once an earlier stage is done with it: use it as
        a context manager around that stage and pass it to ``submit``."""
        return Expected(self)

    async def submit(self, key, payload: P, run: Callable[[Any, list[P]], list[R]] | None = None,
                     expected: Expected | None = None) -> R:
        """This payload's result, possibly computed in one call with other requests' payloads of the
        same ``key`` (and the same ``run``, default the batcher's)."""
        run = run or self.run
        loop = asyncio.get_running_loop()
        if expected is not None:
            expected.arrive(self)
        if not self.enabled or self._queue is None:
            # unbatched: every request on its own thread, in parallel (the baseline batching is measured against)
            if self.on_batch:
                self.on_batch(self.size(payload))
            if self._unbatched is None:
                self._unbatched = ThreadPoolExecutor(thread_name_prefix=f"{self.name}-unbatched")
            results = await self._on_thread(self._unbatched, run, key, [payload])
            return results[0]
        if self._queue.qsize() >= self.max_queued:
            raise Overloaded(f"the {self.name} queue holds {self.max_queued} waiting requests")
        future = loop.create_future()
        self._queue.put_nowait(_Item(key, payload, run, future, time.monotonic()))
        return await future

    async def run_alone(self, fn: Callable[..., Any], *args) -> Any:
        """``fn(*args)`` on this batcher's thread, between batches (image queries on the encoder's thread)."""
        return await self._on_thread(self._executor, fn, *args)

    @property
    def idle(self) -> bool:
        """Nothing queued and no call running on this batcher's threads, a call whose request gave up
        included (a thread cannot be stopped: it still holds the cores until it returns)."""
        return self._on_threads == 0 and self.pending == 0

    def _on_thread(self, executor: ThreadPoolExecutor, fn: Callable[..., Any], *args) -> asyncio.Future:
        with self._on_threads_lock:
            self._on_threads += 1
        future = executor.submit(fn, *args)
        # runs on the thread once fn returns, or here if the call is cancelled before it starts
        future.add_done_callback(self._off_thread)
        return asyncio.wrap_future(future)

    def _off_thread(self, _future) -> None:
        with self._on_threads_lock:
            self._on_threads -= 1

    async def _loop(self) -> None:
        assert self._queue is not None  # start() made it
        queue = self._queue
        while True:
            first = await queue.get()
            if first is _WAKE:
                continue
            items = [first]
            units = self.size(first.payload)
            # this worker's share of what waits; the other idle workers take the rest at once
            share = self._share(queue.qsize() + 1)
            now = time.monotonic()
            deadline, expect_deadline = now + self.max_wait, now + self.max_expect_wait
            company_deadline = now + self.max_company_wait
            while units < self.max_batch_size and len(items) < share:
                if not queue.empty():
                    item = queue.get_nowait()
                else:
                    # no more waiting: go now, unless announced requests are on their way (bounded), the
                    # current load's requests are (bounded, while another call runs), or an extra wait for
                    # company is configured
                    load_coming = self._running > 0 and (self.coming is None or self.coming() > 0)
                    company_wait = company_deadline if load_coming else now
                    timeout = max(deadline, company_wait, expect_deadline if self._expected > 0 else now) - time.monotonic()
                    if timeout <= 0:
                        break
                    try:
                        item = await asyncio.wait_for(queue.get(), timeout)
                    except TimeoutError:
                        break
                if item is not _WAKE:
                    items.append(item)
                    units += self.size(item.payload)
            groups: dict[tuple[int, int], list[_Item]] = {}
            for item in items:  # dicts keep insertion order: groups run in arrival order
                groups.setdefault((id(item.key), id(item.run)), []).append(item)
            self._idle -= 1
            try:
                for group in groups.values():
                    await self._dispatch(group)
            finally:
                self._idle += 1

    def _share(self, waiting: int) -> int:
        """How many payloads this worker's next call takes. One worker: everything waiting. Several:
        what waits split among the idle workers, or with ``load`` the load split among all workers,
        so that under steady load the calls are even (a worker taking everything queued while the
        other runs leaves that one the stragglers: calls of 7 and 1 instead of 4 and 4)."""
        if self.workers == 1:
            return self.max_batch_size
        if self.load is None or self.max_company_wait <= 0:
            return math.ceil(waiting / max(1, self._idle))
        return math.ceil(max(self.load(), waiting + self._running) / self.workers)

    async def _dispatch(self, items: list[_Item]) -> None:
        live = [item for item in items if not item.future.done()]  # a cancelled request needs no work
        if not live:
            return
        key, run = live[0].key, live[0].run
        if self.on_batch:
            self.on_batch(sum(self.size(item.payload) for item in live))
        if self.on_wait:
            now = time.monotonic()
            for item in live:
                self.on_wait(now - item.queued_at)
        self._running += len(live)
        try:
            results = await self._on_thread(self._executor, run, key, [item.payload for item in live])
        except Exception as exc:
            if len(live) == 1:
                _settle(live[0].future, error=exc)
                return
            # one request's bad input must not fail the others merged with it: retry one by one
            for item in live:
                try:
                    (result,) = await self._on_thread(self._executor, run, key, [item.payload])
                except Exception as exc:
                    _settle(item.future, error=exc)
                else:
                    _settle(item.future, result=result)
            return
        finally:
            self._running -= len(live)
        for item, result in zip(live, results):
            _settle(item.future, result=result)


class RecentPeak:
    """The largest value observed in the last ``window_s`` to ``2 * window_s`` seconds (two buckets:
    constant time and memory): the service's concurrency, which a moment's count understates because
    the clients of a closed loop are between requests part of the time."""

    def __init__(self, window_s: float = 0.5, clock: Callable[[], float] = time.monotonic):
        self.window = window_s
        self.clock = clock
        self._start = clock()
        self._current = self._previous = 0

    def _roll(self) -> None:
        elapsed = self.clock() - self._start
        if elapsed >= self.window:
            # one window passed: the current bucket becomes the previous; two or more: both are stale
            self._previous = self._current if elapsed < 2 * self.window else 0
            self._current = 0
            self._start = self.clock()

    def observe(self, value: int) -> None:
        self._roll()
        self._current = max(self._current, value)

    def __call__(self) -> int:
        self._roll()
        return max(self._current, self._previous)


class LoneCallGate:
    """Lets a call that starts while no other runs take every core, and holds the calls that start
    during it until it ends, so a lone call and a single-threaded one never share the cores.

    The encoder's workers run single-threaded calls side by side under load (more texts/s than one
    call on every core); a call that may run alone (the service's only request: low load) and finds
    no other call running has the cores to itself, so one text costs less than the single-threaded
    call."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._running = 0
        self._lone = False

    @contextmanager
    def call(self, may_run_alone: bool = True) -> Iterator[bool]:
        """Around one call; yields whether it runs alone (and may use every core)."""
        with self._cond:
            self._cond.wait_for(lambda: not self._lone)
            lone = may_run_alone and self._running == 0
            self._running += 1
            self._lone = lone
        try:
            yield lone
        finally:
            with self._cond:
                self._running -= 1
                if lone:
                    self._lone = False
                self._cond.notify_all()


def _settle(future: asyncio.Future, result=None, error: BaseException | None = None) -> None:
    if future.done():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)


# -- the merged calls the service makes ------------------------------------------------------------
def encode_texts(encode: Callable[[Any, list[str]], tuple[np.ndarray, list[bool]]]):
    """``run`` for the encoder batcher: payloads are lists of texts; one encoder call for all of them."""
    def run(model, payloads: list[list[str]]) -> list[tuple[np.ndarray, list[bool]]]:
        texts = [t for texts in payloads for t in texts]
        vectors, truncated = encode(model, texts)
        out, start = [], 0
        for texts in payloads:
            end = start + len(texts)
            out.append((vectors[start:end], truncated[start:end]))
            start = end
        return out
    return run


def search_rows(search: Callable[[Any, np.ndarray, int], tuple[np.ndarray, np.ndarray]]):
    """``run`` for the index batcher: payloads are (query rows, k); one search of all rows at the
    largest k, each request gets its own rows cut to its own k."""
    def run(target, payloads: Sequence[tuple[np.ndarray, int]]) -> list[tuple[np.ndarray, np.ndarray]]:
        matrix = np.vstack([rows for rows, _ in payloads]) if len(payloads) > 1 else payloads[0][0]
        scores, ids = search(target, matrix, max(k for _, k in payloads))
        out, start = [], 0
        for rows, k in payloads:
            end = start + len(rows)
            out.append((scores[start:end, :k], ids[start:end, :k]))
            start = end
        return out
    return run
