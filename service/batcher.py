"""Micro-batching: texts of concurrent requests are merged into one encoder call.

Requests put their texts on a queue and await futures. One worker takes the first waiting item,
collects more until ``max_batch_size`` texts or ``max_wait_ms`` pass, encodes them all in one call on a
worker thread (off the event loop) and hands each request its rows. With batching off, every request
encodes its own texts on a thread.
"""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor
from itertools import groupby
from typing import Any, Callable

import numpy as np


class MicroBatcher:
    def __init__(self, encode: Callable[[Any, list[str]], tuple[np.ndarray, list[bool]]], *, max_batch_size: int = 64,
                 max_wait_ms: float = 2.0, enabled: bool = True, on_batch: Callable[[int], None] | None = None):
        self.encode = encode
        self.max_batch_size = max_batch_size
        self.max_wait = max_wait_ms / 1000.0
        self.enabled = enabled
        self.on_batch = on_batch
        # one encoder thread: onnxruntime already uses every core for one call
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="encoder")
        self._queue: asyncio.Queue | None = None
        self._worker: asyncio.Task | None = None

    async def start(self) -> None:
        if self.enabled and self._worker is None:
            self._queue = asyncio.Queue()
            self._worker = asyncio.create_task(self._run(), name="micro-batcher")

    async def stop(self) -> None:
        if self._worker is not None:
            self._worker.cancel()
            try:
                await self._worker
            except asyncio.CancelledError:
                pass
            self._worker = None
        self._executor.shutdown(wait=False, cancel_futures=True)

    async def submit(self, model, texts: list[str]) -> tuple[np.ndarray, list[bool]]:
        """Embeddings and truncation flags of ``texts`` by ``model``, possibly computed in one call with
        other requests' texts for the same model (after a reload, old and new models never mix)."""
        loop = asyncio.get_running_loop()
        if not self.enabled or self._queue is None:
            if self.on_batch:
                self.on_batch(len(texts))
            return await loop.run_in_executor(None, self.encode, model, texts)
        fut = loop.create_future()
        await self._queue.put((model, texts, fut))
        return await fut

    async def run(self, fn: Callable[..., Any], *args) -> Any:
        """``fn(*args)`` on the encoder's thread (image queries): one model call at a time uses the cores."""
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    async def _run(self) -> None:
        assert self._queue is not None  # start() made it
        while True:
            first = await self._queue.get()
            items = [first]
            count = len(first[1])
            deadline = time.monotonic() + self.max_wait
            while count < self.max_batch_size:
                timeout = deadline - time.monotonic()
                try:
                    if timeout <= 0:  # take whatever is already waiting, without sleeping
                        item = self._queue.get_nowait()
                    else:
                        item = await asyncio.wait_for(self._queue.get(), timeout)
                except (asyncio.QueueEmpty, asyncio.TimeoutError):
                    break
                items.append(item)
                count += len(item[1])
            for _, group in groupby(items, key=lambda item: id(item[0])):
                await self._encode_group(list(group))

    async def _encode_group(self, items: list) -> None:
        loop = asyncio.get_running_loop()
        model = items[0][0]
        texts = [t for _, item_texts, _ in items for t in item_texts]
        if self.on_batch:
            self.on_batch(len(texts))
        try:
            vectors, truncated = await loop.run_in_executor(self._executor, self.encode, model, texts)
        except Exception:
            # one request's bad text must not fail the others merged with it: retry one by one
            for _, item_texts, fut in items:
                try:
                    result = await loop.run_in_executor(self._executor, self.encode, model, item_texts)
                except Exception as exc:
                    if not fut.done():
                        fut.set_exception(exc)
                else:
                    if not fut.done():
                        fut.set_result(result)
            return
        start = 0
        for _, item_texts, fut in items:
            end = start + len(item_texts)
            if not fut.done():
                fut.set_result((vectors[start:end], truncated[start:end]))
            start = end
