"""The search engine: what the service serves and how a request runs through it. Its stages, top to
bottom in ``search``: the request's texts (generated paraphrases included) -> one cached, batched
embedding call -> a vector expansion's lookups -> one batched index call -> the result list and
consistency report (``query_plan``, pure) -> one cached response. Loading and swapping what is served
is in ``runtime``, paraphrase sources and caption banks in ``expansion_sources``."""

from __future__ import annotations

import asyncio
import base64
import functools
import hashlib
import logging
import os
import threading
import time
import weakref
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Awaitable, Callable, Iterable, Iterator, TypeVar

import numpy as np

from paraseek.core.encoder import Encoder
from paraseek.core.images import ImageDecodeError, decode_image
from paraseek.core.memory import freeze_long_lived, limit_malloc_arenas, release_free_memory
from paraseek.core.settings import Settings
from paraseek.index.backends import store_from_settings
from paraseek.index.faiss_index import set_threads
from paraseek.index.filters import FilterError, SearchFilter
from paraseek.index.store import IndexUnavailable, SearchableSnapshot, SearchView, SnapshotStore
from paraseek.index.versions import SnapshotError, SnapshotManifest
from paraseek.paraphrase.caption_bank import CaptionBankError
from paraseek.paraphrase.expansions import EXPANSIONS, HubCorrection
from paraseek.service.batcher import ContinuousBatcher, LoneCallGate, Overloaded, RecentPeak, encode_texts, search_rows
from paraseek.service.cache import Cache, params_key
from paraseek.service.embedding import cached_texts
from paraseek.service.errors import RequestError, StaleSwap
from paraseek.service.expansion_sources import BatchedLookups, ExpansionSources
from paraseek.service.llm_budget import LLM_CALLS_PER_CLIENT_MINUTE, ClientBudget, check_endpoint_calls
from paraseek.service.logging_config import client_address
from paraseek.service.prometheus import ServiceMetrics
from paraseek.service.query_plan import (
    QueryRows,
    QueryTexts,
    consistency_report,
    hub_of,
    keep_of,
    lead_of,
    page,
    plan_rows,
    query_vectors,
    ranked_page,
    result_of,
    rewrite_expansion,
    vector_expansion,
)
from paraseek.service.runtime import (
    Active,
    default_text_batch,
    encoder_id,
    encoder_workers,
    load_active,
    load_first_answer_bundle,
    load_snapshot,
    text_sub_batch,
    validate_snapshot,
)
from paraseek.service.schemas import EmbeddingsRequest, Expansion, SearchRequest, SearchResponse

log = logging.getLogger(__name__)
T = TypeVar("T")
RETRY_LOAD_S = 5.0  # a service that could not load its index at start tries again this often
FIRST_ANSWER_POLL_S = 1.0  # how often a first start's server looks for the first-answer bundle built beside it
# an encoder call of at most this many texts runs on every core when its request is the only one in
# flight: it carries 1 text, or 4 with a consistency report
SOLO_MAX_TEXTS = 4


def counted(method: Callable[..., Awaitable[T]]) -> Callable[..., Awaitable[T]]:
    """A request of the engine: refused at once (``Overloaded``) when ``max_in_flight`` are being
    answered, counted in ``SearchEngine.in_flight`` while it runs, and given up after
    ``request_timeout_s`` (``Overloaded`` too: the work it waited for is cancelled where it can be)."""
    @functools.wraps(method)
    async def run(self: SearchEngine, *args, **kwargs) -> T:
        if self.in_flight >= self.settings.max_in_flight:
            self.metrics.shed.labels("in_flight").inc()
            raise Overloaded(f"{self.in_flight} requests are being answered (PARASEEK_MAX_IN_FLIGHT)")
        self.in_flight += 1
        # the encoder's load: requests in flight that are not waiting at the index (at concurrency 32
        # most searches are; counting them, encoder calls waited for company that was not coming)
        self.encoder_load.observe(self.in_flight - self.index_batcher.pending)
        self.recent_in_flight.observe(self.in_flight)
        self.metrics.in_flight.set(self.in_flight)
        try:
            # one pass of the loop first: the requests read together all get this far before any reaches the
            # encoder's queue, which forms fuller calls (concurrency 32, 100K flat, 2 cores: 380 requests/s
            # against 329). Not wait_for, which made that pass with a task of its own: that task also ended
            # on a pass of its own, so an answer took two passes and the first went out only once every
            # other one was built (concurrency 32: 359 -> 371 requests/s, medians of 4 alternating runs)
            await asyncio.sleep(0)
            async with asyncio.timeout(self.settings.request_timeout_s):
                return await method(self, *args, **kwargs)
        except TimeoutError:
            self.metrics.shed.labels("deadline").inc()
            raise Overloaded(f"no answer within {self.settings.request_timeout_s:g} s (PARASEEK_REQUEST_TIMEOUT_S)") from None
        except Overloaded:
            self.metrics.shed.labels("queue").inc()
            raise
        finally:
            self.in_flight -= 1
            self.metrics.in_flight.set(self.in_flight)
    return run


@dataclass
class Searched:
    """What the encoder and index stages give the rest of a search."""

    truncated: list[bool]
    rows: QueryRows
    scores: np.ndarray
    ids: np.ndarray
    t_enc: float  # when the vectors to search were ready
    t_embedded: float  # when the texts' vectors were ready (before a vector expansion's lookups)
    neighbour_texts: list[str] = field(default_factory=list)  # the caption bank's captions (bank expansion)


class SearchEngine:
    """The search service as a library object: what it serves (``Active``, swapped atomically), the
    request pipeline (texts -> encoder batch -> index batch -> results), its caches and back-pressure.
    The FastAPI app (``paraseek.service.main``) is a thin adapter over it."""

    def __init__(self, settings: Settings, metrics: ServiceMetrics, first_answer_pending: Path | None = None):
        """``first_answer_pending``: a first-answer bundle being built beside the server (the embedded
        default's first start), served once it is in place."""
        self.settings = settings
        self.first_answer_pending = first_answer_pending
        self.metrics = metrics
        self.active: Active | None = None
        self.cache = Cache(
            metrics, settings.redis_url, timeout_s=settings.redis_timeout_s,
            connect_timeout_s=settings.redis_connect_timeout_s, retry_after_s=settings.redis_retry_after_s,
            failures_to_open=settings.redis_failures_to_open, embedding_ttl_s=settings.embedding_ttl_s,
            result_ttl_s=settings.result_ttl_s, lru_size=settings.lru_size,
        )
        self.encoder_load = RecentPeak()  # the load the encoder batcher forms its batches for (``counted``)
        self.recent_in_flight = RecentPeak()  # the most requests in flight lately (``counted``)
        # the request pipeline: texts -> encoder batch -> index batch -> results; each stage merges
        # concurrent requests into one call on its own thread
        self.encoder_batcher: ContinuousBatcher = ContinuousBatcher(
            encode_texts(self._encode), name="encoder", max_batch_size=settings.max_batch_size or 64,
            max_wait_ms=settings.max_wait_ms, enabled=settings.batching, size=len, on_batch=metrics.batch_size.observe,
            workers=encoder_workers(settings), max_queued=settings.max_queued_batches,
            on_wait=metrics.batch_wait.labels("encoder").observe,
            load=self.encoder_load, max_company_wait_ms=settings.max_company_wait_ms,
            coming=lambda: self.recent_in_flight() - self._at_encoder_or_past,
        )
        self.index_batcher: ContinuousBatcher = ContinuousBatcher(
            search_rows(self._search_snapshot), name="index", max_batch_size=settings.max_index_batch_size,
            enabled=settings.batching, size=lambda payload: len(payload[0]), on_batch=metrics.index_batch_size.observe,
            max_expect_wait_ms=settings.max_index_wait_ms, max_queued=settings.max_queued_batches,
            on_wait=metrics.batch_wait.labels("index").observe,
        )
        self.expansion_sources = ExpansionSources(settings)
        self._lone_calls = LoneCallGate()
        self.llm_budget = ClientBudget(LLM_CALLS_PER_CLIENT_MINUTE)
        self.in_flight = 0  # requests being answered (search, image, similar, embeddings)
        # searches from their encoder call's submission until their own search is done: of the recent
        # load, the others may still bring texts to the encoder (its batcher's ``coming``)
        self._at_encoder_or_past = 0
        # how long the lone requests' encoder call and search took lately (a moving average), and for what
        # was served then (weakly: a replaced snapshot is freed at once): whether the next one may run on
        # the event loop's thread
        self._alone_ms: tuple[weakref.ref[Active], float] | None = None
        self.default_expansion = (Expansion.model_validate_json(settings.default_expansion)
                                  if settings.default_expansion else None)
        self._swap_lock = threading.Lock()  # swaps come from the event loop, reindex jobs and the watcher
        self.load_error: str | None = None
        self.store: SnapshotStore | None = None

    # -- lifecycle ---------------------------------------------------------------------------
    async def start(self) -> None:
        limit_malloc_arenas()
        await self.encoder_batcher.start()
        await self.index_batcher.start()
        try:
            await asyncio.to_thread(self._load)
        except Exception as exc:  # serve /healthz and report not ready, rather than crash-looping
            # clients see the kind of failure; the message, with server paths, goes to the log only
            self.load_error = f"{type(exc).__name__} (see the server log)"
            log.error("model or index not loaded: %s: %s", type(exc).__name__, exc)
        # follow the current version (another replica's reindex); without polling, retry a failed
        # start (an index backend that was not up yet) until it loads
        if self.settings.snapshot_poll_s > 0 or self.active is None:
            self._watcher = asyncio.create_task(self._watch_snapshot(), name="snapshot-watcher")
        if self.first_answer_pending is not None:
            self._first_answer_watch = asyncio.create_task(self._await_first_answer(self.first_answer_pending),
                                                           name="first-answer")
        # warm WordNet (and the caption bank of a default bank expansion) in the background so the
        # first request that needs them does not pay for it; /readyz says "warming up" until then
        self._preload = asyncio.create_task(asyncio.to_thread(self._warm_up), name="warm-up")

    @property
    def warm(self) -> bool:
        preload = getattr(self, "_preload", None)
        return preload is not None and preload.done()

    def _warm_up(self) -> None:
        # what every request of a default bank expansion needs first (the bank and its hub table), then
        # WordNet, which only consistency reports and rewrite expansions ask for (3-5 s, mostly Python)
        active, expansion = self.active, self.default_expansion
        method = EXPANSIONS.get(expansion.method) if expansion is not None else None  # None for "none"
        if active is not None and expansion is not None and (expansion.hub_weight or (method is not None and method.uses_bank)):
            try:
                self.expansion_sources.caption_bank(active)
                if self.hub_corrects_by_default:  # the served version's hub table, built beside the first requests
                    self.expansion_sources.start_hub_table(active)
            except RequestError as exc:
                log.warning("default expansion %r unavailable: %s", expansion.method, exc)
        try:
            self.expansion_sources.paraphrase_source("wordnet", "expansion.method")
        except RequestError:
            pass  # not installed: requests that ask for it get a 400
        if self.settings.freeze_heap:
            freeze_long_lived()  # what is loaded by now lives as long as the service (or until a swap)

    async def stop(self) -> None:
        for task in (getattr(self, "_watcher", None), getattr(self, "_first_answer_watch", None)):
            if task is not None:
                task.cancel()
        await self.encoder_batcher.stop()
        await self.index_batcher.stop()
        self.expansion_sources.shutdown()
        await self.cache.close()
        # what it served (encoder sessions, index) goes now: the app and the engine refer to each other,
        # and a cycle is only freed by a full collection, which a process that stops and starts apps
        # (tests, an embedding host) may not run before the next app is loaded beside it
        self.active = None

    def _load(self) -> None:
        """Open the index backend, clear what interrupted builds left, load the current version."""
        if self.store is None:
            self.store = store_from_settings(self.settings)
        removed = self.store.clean_stale()
        if removed:
            log.warning("removed what interrupted builds left behind: %s", removed)
        self.store.manifest()  # no published version yet: fail here, before loading an encoder (retried every few s)
        self.swap(load_active(self.settings.bundle_dir, self.store, self.settings), replaces=None)

    async def _watch_snapshot(self) -> None:
        """Follow the current version (the snapshot root's ``current``, or the Milvus alias): another
        replica's reindex, or a CLI build."""
        while True:
            await asyncio.sleep(self.settings.snapshot_poll_s or RETRY_LOAD_S)
            if self.active is not None and self.settings.snapshot_poll_s <= 0:
                return  # a reindex built the first version meanwhile; without polling, nothing to follow
            try:
                if self.active is None:
                    await asyncio.to_thread(self._load)
                    log.info("now serving snapshot %s", self.require_active().snapshot.version)
                    if self.settings.snapshot_poll_s <= 0:
                        return  # loaded: nothing more to follow
                    continue
                assert self.store is not None
                version = await asyncio.to_thread(self.store.current_version)
                active = self.active
                if version and version != active.snapshot.version:
                    snap = await asyncio.to_thread(load_snapshot, self.store, active.encoder.image_space, self.settings)
                    # StaleSwap: the next poll looks again. On a thread: the swap lock may be held by a job publishing
                    await asyncio.to_thread(self.swap, replace(active, snapshot=snap), active)
                    log.info("now serving snapshot %s (current changed)", version)
            except Exception as exc:  # keep serving what we have
                log.warning("snapshot not loaded: %s: %s", type(exc).__name__, exc)

    async def _await_first_answer(self, bundle: Path) -> None:
        """Serve the first-answer bundle once its build has moved it into place whole; requests are
        answered without it meanwhile (no lead_margin, the served tower's sentence embeddings)."""
        while True:
            await asyncio.sleep(FIRST_ANSWER_POLL_S)
            active = self.active
            if active is None or not (bundle / "manifest.json").is_file():
                continue
            if active.first_answer is not None:
                return
            try:
                first = await asyncio.to_thread(load_first_answer_bundle, bundle, self.settings, active.encoder)
                await asyncio.to_thread(self.swap, replace(active, first_answer=first), active)
            except StaleSwap:
                continue  # a reload or reindex came in between: added to what serves now at the next look
            except Exception as exc:
                log.warning("first-answer bundle %s not served: %s: %s", bundle, type(exc).__name__, exc)
                return
            log.info("now serving the first-answer bundle %s", bundle)
            return

    def swap(self, active: Active, replaces: Active | None, publish: Callable[[], None] | None = None) -> None:
        """Serve ``active`` in place of ``replaces``, the one the caller read before its slow work
        (loading a bundle, building a version). Blocking (a lock that a publishing job holds, a heap
        clean-up): called from a thread, never on the event loop. When another swap came in between, nothing changes and
        ``StaleSwap`` says so: a reload made during a reindex is never silently reverted. ``publish``
        (making the new version current in the store) runs under the same lock, just before the switch."""
        with self._swap_lock:
            if self.active is not replaces:
                raise StaleSwap("the service changed while this ran (a reload, a reindex or a new current "
                                "version): nothing was replaced; try again")
            if publish is not None:
                publish()
            self.active = active  # one reference assignment: atomic for concurrent requests
            self.load_error = None
        self.encoder_batcher.max_batch_size = self.settings.max_batch_size or default_text_batch(active.encoder)
        self.metrics.index_size.set(len(active.snapshot))
        self.metrics.serving(active.snapshot.version, active.snapshot.backend, f"{active.encoder.name}:{active.encoder.version}")
        bank = self.expansion_sources.loaded_bank(active) if self.hub_corrects_by_default else None
        if bank is not None:
            # a new version of the served tower (reindex, another replica's): its hub table at once (prepared by a
            # reindex, or read back where ``paraseek index build`` wrote it), not at its first request
            self.expansion_sources.start_hub_table(active, bank)
        if replaces is not None and replaces is not active:
            # the replaced encoder/index back to the OS, not just to the heap; the new one out of the collector's reach
            if self.settings.freeze_heap:
                freeze_long_lived()
            else:
                release_free_memory()

    def serve_version(self, version: str | None) -> tuple[SnapshotManifest, str]:
        """Serve a published version of the index and make it current: an admin rollback (``None``: the version
        ``SnapshotStore.previous_version`` names) or forward again. Loaded and validated before the swap, as a
        reindex's version is; its hub table is read back where it was written, else built on a thread after
        the swap (a rollback does not wait minutes for it). -> (its manifest, the version served before). RequestError
        on ``version``: 404 no such version, 409 one that does not load or answer (the served one stays);
        StaleSwap: the service changed meanwhile (nothing replaced)."""
        active = self.require_active()
        store = self.store
        assert store is not None  # set by the load that made ``active``
        try:
            target = store.previous_version() if version is None else version
        except SnapshotError as exc:
            raise RequestError("version", str(exc), status=404) from exc
        if target not in store.versions():
            raise RequestError("version", f"no published version {target!r}", status=404)
        was = active.snapshot.version
        if target == was:
            if store.current_version() != target:  # served, but another writer moved ``current`` since
                store.activate(target)
            return active.snapshot.manifest, was
        try:
            new = replace(active, snapshot=load_snapshot(store, active.encoder.image_space, self.settings, target))
        except IndexUnavailable:
            raise  # an outage (503, retry), not a version that cannot be served
        except Exception as exc:  # altered files, another image space: the log has the detail
            log.warning("version %s not served: %s: %s", target, type(exc).__name__, exc)
            raise RequestError("version", f"version {target} cannot be served: {type(exc).__name__} (see the server "
                               "log)", status=409) from exc
        try:
            validate_snapshot(new)
            if self.hub_corrects_by_default:
                try:  # a table written earlier serves from the first request; a missing one is built after the swap
                    self.expansion_sources.prepare_hub_table(new, compute=False)
                except Exception:  # the swap's own build (or per-image hubness) serves
                    log.exception("version %s: hub table not read before the swap", target)
            self.swap(new, replaces=active, publish=lambda: store.activate(target))
        except BaseException:
            new.snapshot.close()  # the version that was not swapped in; the served one stays
            raise
        log.info("now serving snapshot %s (activated; was %s)", target, was)
        return new.snapshot.manifest, was

    def published_versions(self) -> tuple[list[SnapshotManifest], str | None, str]:
        """What ``serve_version`` can serve: the published versions' manifests, oldest first; the version the
        store names current (what replicas that poll serve); the one this server answers from."""
        active = self.require_active()
        store = self.store
        assert store is not None  # set by the load that made ``active``
        return store.published_manifests(), store.current_version(), active.snapshot.version

    @property
    def hub_corrects_by_default(self) -> bool:
        """Whether the default expansion orders lists by hubness (every version served then wants its table)."""
        return self.default_expansion is not None and bool(self.default_expansion.hub_weight)

    @property
    def ready(self) -> bool:
        return self.active is not None

    def require_active(self) -> Active:
        if self.active is None:
            raise RequestError("service", f"not ready: {self.load_error or 'loading'}", status=503)
        return self.active

    # -- index -----------------------------------------------------------------------------------
    def _search_snapshot(self, view: SearchView, queries: np.ndarray, k: int,
                         alone: bool = False) -> tuple[np.ndarray, np.ndarray]:
        """One merged index search, on the index batcher's thread. OpenMP's thread count is a per-thread
        setting, so it is set here, where faiss runs: PARASEEK_FAISS_THREADS (default 1) for one row
        while other requests are in flight, PARASEEK_FAISS_BATCH_THREADS (default every core) for merged
        rows and for a lone request's search, whose encoder call has just left every core idle (an exact
        scan then splits the collection among them: 100K x 512, 19.7 -> 11.1 ms on 2 cores)."""
        single = len(queries) == 1 and not alone
        set_threads(self.settings.faiss_threads if single else self.settings.faiss_batch_threads or os.cpu_count())
        return view.search_ids(queries, k)

    async def view(self, snapshot: SearchableSnapshot, flt: SearchFilter | None) -> SearchView:
        """What the index searches: the snapshot, or its view restricted to ``flt`` (compiled once per
        distinct filter and snapshot, off the event loop: a FAISS filter reads every metadata row once)."""
        if flt is None:
            return snapshot
        try:
            return await asyncio.to_thread(snapshot.filtered, flt)
        except FilterError as exc:
            raise RequestError(exc.field, str(exc)) from exc

    @staticmethod
    async def metadata(snapshot: SearchableSnapshot, ids) -> dict[int, dict]:
        """Metadata rows of result ids: a dict lookup for FAISS, one query for Milvus (off the event loop)."""
        ids = [int(i) for i in ids]
        if snapshot.backend == "faiss":
            return snapshot.metadata_of(ids)
        return await asyncio.to_thread(snapshot.metadata_of, ids)

    # -- embeddings ----------------------------------------------------------------------------
    def _encode(self, encoder: Encoder, texts: list[str]) -> tuple[np.ndarray, list[bool]]:
        # alone: no other request in flight (under load the workers' single-threaded calls do more)
        alone = encoder.has_solo_session and len(texts) <= SOLO_MAX_TEXTS and self.in_flight <= 1
        with self._lone_calls.call(alone) as solo:
            # a lone call runs in one run on every core; others in runs of similar length
            run = (None if solo else text_sub_batch(encoder, self.settings)) or len(texts)
            return encoder.encode_text_detailed(texts, batch_size=max(run, 1), solo=solo)

    async def embed(self, active: Active, texts: list[str], encoder: Encoder | None = None) -> tuple[np.ndarray, list[bool]]:
        """Rows for ``texts`` (deduplicated) by ``encoder`` (default: the served one; else the first-answer
        tower), from the cache where possible, the rest in one call."""
        encoder = encoder or active.encoder
        model_id = encoder_id(encoder)
        lookup = await cached_texts(self.cache, encoder, texts)
        if not lookup.missing:
            return lookup.assemble(encoder, None, [])
        vectors, flags = await self.encoder_batcher.submit(encoder, lookup.missing)
        await self.cache.put_embeddings(model_id, lookup.missing_fingerprints, vectors)
        return lookup.assemble(encoder, vectors, flags)

    # -- search --------------------------------------------------------------------------------
    def effective_expansion(self, req: SearchRequest) -> SearchRequest:
        """The request with the server's default expansion applied when it names none; an explicit
        ``{"method": "none"}`` opts out (with a ``hub_weight``, that correction alone)."""
        if req.expansion is not None:
            e = req.expansion
            return req if e.method != "none" or e.hub_weight > 0 else req.model_copy(update={"expansion": None})
        if self.default_expansion is None or req.query is None or req.terms:
            return req
        return req.model_copy(update={"expansion": self.default_expansion})

    @counted
    async def search(self, req: SearchRequest) -> dict:
        """The response as a JSON-ready dict (the route returns it without re-validating it).

        Stages: texts (query, expansions, paraphrases, terms) -> one embedding call -> the vectors to
        search -> one index call -> results fused into a list -> consistency report."""
        t0 = time.perf_counter()
        active = self.require_active()
        self._check_lengths(self._request_texts(req))
        req = self.effective_expansion(req)
        lead = lead_of(req)
        if lead and active.first_answer is None:
            raise RequestError("expansion.lead_margin", "this server has no first-answer tower to lead with: set "
                               "PARASEEK_FIRST_ANSWER_BUNDLE to a bundle of the served image space", status=400)
        model = active.model_id + (f"+{active.first_answer_id}" if lead else "")
        key = params_key({"snapshot": active.snapshot.version, "model": model, "request": req.model_dump()})
        hit = await self._cached(key, t0)
        if hit is not None:
            return hit

        view = await self.view(active.snapshot, req.filter)
        t_texts = time.perf_counter()
        texts = await self._texts(req)  # paraphrase sources may take seconds: before the encoder call
        t_generated = time.perf_counter()
        # keep_first: the expanded list loses up to that many results to the plain query's first ones (lead: one more)
        k_search = max(req.offset + req.k, req.consistency.k if req.consistency else 0) + keep_of(req).depth + int(bool(lead))
        hub = hub_of(req)
        k_search = hub.depth(k_search)
        if self._runs_alone(req, texts):
            searched = await self._encode_and_search_alone(active, view, req, texts, k_search)
        else:
            searched = await self._encode_then_search(active, view, req, texts, k_search)
        if hub:
            await self._correct_hubs(active, hub, searched)
        t_enc, t_search = searched.t_enc, time.perf_counter()
        stage = self.metrics.stage
        if texts.expansions or (req.consistency and req.consistency.auto):  # generated texts only
            stage.labels("paraphrase").observe(t_generated - t_texts)
        stage.labels("encode").observe(searched.t_embedded - t_generated)
        if searched.t_enc > searched.t_embedded:
            stage.labels("expand").observe(searched.t_enc - searched.t_embedded)
        stage.labels("search").observe(t_search - t_enc)

        ranked = ranked_page(req.k, req.offset, searched.scores, searched.ids, searched.rows)
        t_fused = time.perf_counter()
        stage.labels("fusion").observe(t_fused - t_search)
        report = None
        if texts.paraphrases:
            report = consistency_report(req, texts.paraphrases, searched.scores, searched.ids, searched.rows,
                                        self.settings.consistency_threshold)
            stage.labels("consistency").observe(time.perf_counter() - t_fused)
            self.metrics.consistency_ao.observe(report.mean_ao)
            self.metrics.consistency_reports.labels("true" if report.stable else "false").inc()
        return await self._respond(
            key, active, ranked, t0, t_enc, t_search,
            truncated=bool(searched.truncated[0]) if req.query is not None else any(searched.truncated),
            expansions=(texts.expansions or searched.neighbour_texts) or None, consistency=report,
        )

    async def _correct_hubs(self, active: Active, hub: HubCorrection, searched: Searched) -> None:
        """``hub_weight``: the served tower's lists reordered by their hub-corrected scores (the first-answer
        tower's lists keep that tower's own scores: the bank's hubness is the served tower's)."""
        lead = set(searched.rows.lead_rows())
        rows = [r for r in range(len(searched.ids)) if r not in lead]
        try:
            bias = await asyncio.to_thread(self.expansion_sources.hub_bias, active, searched.ids[rows])
        except RequestError as exc:  # no caption bank: the field that needs one is this one
            raise RequestError("expansion.hub_weight", str(exc), status=exc.status) from exc
        searched.scores, searched.ids = searched.scores.copy(), searched.ids.copy()
        searched.scores[rows], searched.ids[rows] = hub.rerank(searched.scores[rows], searched.ids[rows], bias)

    def _runs_alone(self, req: SearchRequest, texts: QueryTexts) -> bool:
        """The service's only request in flight, with few texts, one encoder and no index lookup between
        encoding and search (bank and prf expansions make one)."""
        return (self.in_flight == 1 and vector_expansion(req) is None and not lead_of(req)
                and len(texts.all()) <= SOLO_MAX_TEXTS)

    async def _encode_and_search_alone(self, active: Active, view: SearchView, req: SearchRequest, texts: QueryTexts,
                                       k: int) -> Searched:
        """Encoder call and index search as one call, on the index's thread (one search at a time still)
        or, where they are cheap and nothing else runs, on the event loop's own: at low load this saves the
        round trip through the event loop between the two stages (about 0.6 ms per request on 2 cores) and
        then the hand-offs to and from a thread (about 0.35 ms more), and nothing else is waiting to be
        merged with it."""
        lookup = await cached_texts(self.cache, active.encoder, texts.all())

        def encode_and_search() -> tuple[np.ndarray | None, Searched]:
            vectors, flags = self._encode(active.encoder, lookup.missing) if lookup.missing else (None, [])
            embedded, truncated = lookup.assemble(active.encoder, vectors, flags)
            t_enc = time.perf_counter()
            rows = plan_rows(req, query_vectors(req, texts, embedded))
            scores, ids = self._search_snapshot(view, rows.matrix, k, alone=True)
            return vectors, Searched(truncated, rows, scores, ids, t_enc, t_enc)

        if lookup.missing:
            self.metrics.batch_size.observe(len(lookup.missing))
        on_event_loop = self._alone_on_event_loop(active)
        if on_event_loop:
            await asyncio.sleep(0)  # requests read with this one start now and count in flight
            on_event_loop = self._alone_on_event_loop(active)
        t0 = time.perf_counter()
        if on_event_loop:
            vectors, searched = encode_and_search()
        else:
            vectors, searched = await self.index_batcher.run_alone(encode_and_search)
        self._lone_call_took(active, (time.perf_counter() - t0) * 1000)
        self.metrics.index_batch_size.observe(len(searched.rows.matrix))
        if vectors is not None:
            await self.cache.put_embeddings(active.model_id, lookup.missing_fingerprints, vectors)
        return searched

    def _alone_on_event_loop(self, active: Active) -> bool:
        """Whether a lone request's encoder call and search run on the event loop's thread: they are cheap
        (PARASEEK_ALONE_ON_EVENT_LOOP_MS, by the last ones for what is served), the service has had no
        other request in flight lately, and nothing runs on the encoder's or the index's threads (such
        as the call of a request that timed out), so no thread call is waited for on the event loop and
        the cores are free. Under load a request can be the only one counted in flight while the
        others read with it have yet to start their tasks: the caller yields once and asks again, and
        the recent peak keeps the next ones off the event loop, where each would hold all the others
        (at concurrency 32 the requests would run one at a time). In-process FAISS
        snapshots only: a Milvus search waits on the network, which must never stall the event loop."""
        limit = self.settings.alone_on_event_loop_ms
        recent = self._alone_ms
        return (limit > 0 and recent is not None and recent[0]() is active and recent[1] <= limit
                and self.in_flight == 1 and self.recent_in_flight() <= 1 and active.snapshot.backend == "faiss"
                and self.encoder_batcher.idle and self.index_batcher.idle)

    def _lone_call_took(self, active: Active, ms: float) -> None:
        recent = self._alone_ms
        if recent is not None and recent[0]() is active:
            ms = 0.8 * recent[1] + 0.2 * ms  # one slow call (a page fault storm, a collection) does not decide
        self._alone_ms = (weakref.ref(active), ms)

    async def _encode_then_search(self, active: Active, view: SearchView, req: SearchRequest, texts: QueryTexts,
                                  k: int) -> Searched:
        """The pipeline's two stages, each merging concurrent requests into one call."""
        # announced to the index stage from encoding until its rows get there: a search that would
        # start alone waits for them instead (an exact scan costs nearly the same for one row as for many)
        with self.index_batcher.expect() as expected, self._at_encoder_or_past_it():
            embedded, truncated = await self.embed(active, texts.all())
            t_embedded = time.perf_counter()
            vectors = query_vectors(req, texts, embedded)
            # the first-answer tower's call runs while the expansion's bank lookups do, not beside the served
            # tower's: both at once measured slower (robust default, 2 cores: 20.3 against 16.1 ms p50)
            lead_call = (asyncio.ensure_future(self.embed(active, [texts.query, *texts.paraphrases], active.first_answer))
                         if lead_of(req) and active.first_answer is not None and texts.query is not None else None)
            try:
                expanded: np.ndarray | None = None
                neighbour_texts: list[str] = []
                method = vector_expansion(req)
                if method is not None and req.expansion is not None and vectors.query is not None:
                    # the paraphrases of a consistency report go through the same expansion as the query, so the
                    # report measures what is served
                    expected.release()  # its own index lookup goes first: nothing may wait for this request meanwhile
                    lookups = BatchedLookups(self.expansion_sources, active, view, self.index_batcher)
                    try:
                        batch, neighbour_texts = await method.expand(
                            np.vstack([vectors.query[None], vectors.paraphrases]), req.expansion.params(), lookups)
                    except CaptionBankError as exc:  # e.g. a bank without the head the request names
                        raise RequestError("expansion.method", str(exc), status=400) from exc
                    expanded, vectors.plain_paraphrases, vectors.paraphrases = batch[0], vectors.paraphrases, batch[1:]
                if lead_call is not None:
                    lead_vectors, _ = await lead_call
                    vectors.lead_query, vectors.lead_paraphrases = lead_vectors[0], lead_vectors[1:]
            finally:
                if lead_call is not None and not lead_call.done():
                    lead_call.cancel()
            t_enc = time.perf_counter()
            rows = plan_rows(req, vectors, expanded, compare_expanded=expanded is not None)
            scores, ids = await self.index_batcher.submit(view, (rows.matrix, k), expected=expected)
        return Searched(truncated, rows, scores, ids, t_enc, t_embedded, neighbour_texts)

    @contextmanager
    def _at_encoder_or_past_it(self) -> Iterator[None]:
        self._at_encoder_or_past += 1
        try:
            yield
        finally:
            self._at_encoder_or_past -= 1

    async def _cached(self, key: str, t0: float) -> dict | None:
        hit = await self.cache.get_result(key)
        if hit is not None:  # stored exactly as served: patch the per-request fields only
            hit["cache"] = "hit"
            hit["timings"] = {"encode_ms": 0.0, "search_ms": 0.0, "total_ms": (time.perf_counter() - t0) * 1000}
        return hit

    # -- image queries ---------------------------------------------------------------------------
    @counted
    async def search_image(self, data: bytes, k: int, offset: int = 0, field: str = "image",
                           flt: SearchFilter | None = None) -> dict:
        """Search with the bundle's image tower applied to an uploaded image."""
        t0 = time.perf_counter()
        active = self.require_active()
        encoder = active.encoder
        if not encoder.has_image_tower:
            raise RequestError(field, f"bundle {encoder.name} has no image tower: image queries need one", status=400)
        key = params_key({"snapshot": active.snapshot.version, "model": active.model_id,
                          "image": hashlib.sha256(data).hexdigest(), "k": k, "offset": offset,
                          "filter": flt.key() if flt else None})
        hit = await self._cached(key, t0)
        if hit is not None:
            return hit
        pixels = await asyncio.to_thread(self._image_pixels, encoder, data, field)
        # the image tower runs on the encoder's thread, so it never competes with a text batch for the cores
        view = await self.view(active.snapshot, flt)
        vector = await self.encoder_batcher.run_alone(encoder.encode_pixels, pixels[None])
        return await self._vector_search(active, view, key, vector, k, offset, t0, time.perf_counter())

    def _image_pixels(self, encoder: Encoder, data: bytes, field: str) -> np.ndarray:
        try:
            with decode_image(data, self.settings.max_image_pixels) as im:
                return encoder.preprocess(im)
        except ImageDecodeError as exc:
            raise RequestError(field, f"the upload {exc}", status=413 if exc.too_large else 422) from exc

    @counted
    async def search_similar(self, image_id: int, k: int, offset: int = 0, include_self: bool = False,
                             flt: SearchFilter | None = None) -> dict:
        """"More like this": the stored vector of an indexed image is the query."""
        t0 = time.perf_counter()
        active = self.require_active()
        snap = active.snapshot
        key = params_key({"snapshot": snap.version, "model": active.model_id, "similar": image_id, "k": k,
                          "offset": offset, "self": include_self, "filter": flt.key() if flt else None})
        hit = await self._cached(key, t0)
        if hit is not None:
            return hit
        view = await self.view(snap, flt)
        try:
            vector = await asyncio.to_thread(snap.vectors_of, [image_id])
        except KeyError:
            raise RequestError("id", f"no image with id {image_id} in snapshot {snap.version}", status=404) from None
        exclude = None if include_self else image_id
        return await self._vector_search(active, view, key, vector, k, offset, t0, time.perf_counter(), exclude)

    async def _vector_search(self, active: Active, view: SearchView, key: str, vector: np.ndarray, k: int, offset: int,
                             t0: float, t_enc: float, exclude: int | None = None) -> dict:
        scores, ids = await self.index_batcher.submit(view, (vector, offset + k + (exclude is not None)))
        t_search = time.perf_counter()
        self.metrics.stage.labels("search").observe(t_search - t_enc)
        return await self._respond(key, active, page(ids[0], scores[0], k, offset, exclude), t0, t_enc, t_search)

    async def _respond(self, key: str, active: Active, ranked: list[tuple[int, float, int]], t0: float, t_enc: float,
                       t_search: float, **fields) -> dict:
        """The response of every search kind, as a JSON-ready dict, stored in the result cache under ``key``."""
        rows = await self.metadata(active.snapshot, [i for i, _, _ in ranked])
        # validated in one call from plain fields: a third cheaper than a model per result (10 results: 34 -> 24 us)
        response = SearchResponse.model_validate({
            "results": [result_of(rows, i, s, rank) for i, s, rank in ranked], "bundle": active.encoder.name,
            "bundle_version": active.encoder.version, "snapshot_version": active.snapshot.version,
            "timings": {"encode_ms": (t_enc - t0) * 1000, "search_ms": (t_search - t_enc) * 1000,
                        "total_ms": (time.perf_counter() - t0) * 1000},
            "cache": "miss" if self.cache.backend != "off" else "off", **fields,
        })
        body = response.model_dump(mode="json", exclude_none=True)
        await self.cache.put_result(key, body)
        return body

    # -- OpenAI-compatible embeddings -------------------------------------------------------------
    @counted
    async def embeddings(self, req: EmbeddingsRequest) -> dict:
        """Text embeddings by the text tower ``model`` names (the served one, or the first-answer one where
        the server has it), through the same cache and micro-batcher as search."""
        active = self.require_active()
        e = active.text_tower(req.model)
        if e is None:
            served = " and ".join(repr(t.name) for t in active.text_towers)
            raise RequestError("model", f"model {req.model!r} is not served here; this service serves {served}", status=404)
        if req.dimensions is not None and req.dimensions != e.dim:
            raise RequestError("dimensions", f"{e.name} embeds into {e.dim} dimensions, not {req.dimensions}")
        texts = req.input
        if len(texts) > self.settings.max_embedding_inputs:
            raise RequestError("input", f"at most {self.settings.max_embedding_inputs} texts per call")
        self._check_lengths((f"input.{i}", text) for i, text in enumerate(texts))
        vectors, _ = await self.embed(active, texts, e)
        tokens = int(e.tokenize(texts).attention_mask.sum())
        if req.encoding_format == "base64":  # what OpenAI's clients decode: little-endian float32 bytes
            encoded: list = [base64.b64encode(np.asarray(v, "<f4").tobytes()).decode("ascii") for v in vectors]
        else:
            encoded = np.asarray(vectors, np.float32).tolist()
        return {"object": "list", "model": e.name, "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
                "data": [{"object": "embedding", "index": i, "embedding": v} for i, v in enumerate(encoded)]}

    def _check_lengths(self, fields: Iterable[tuple[str, str]]) -> None:
        """Every text a request embeds (query, terms, paraphrases, embeddings input) within
        PARASEEK_MAX_QUERY_CHARS; 422 naming the first that is not."""
        limit = self.settings.max_query_chars
        for name, text in fields:
            if len(text) > limit:
                raise RequestError(name, f"text is longer than {limit} characters")

    @staticmethod
    def _request_texts(req: SearchRequest) -> Iterator[tuple[str, str]]:
        if req.query is not None:
            yield "query", req.query
        for i, term in enumerate(req.terms or []):
            yield f"terms.{i}.text", term.text

    async def _texts(self, req: SearchRequest) -> QueryTexts:
        """Stage 1: every text of the request, generated ones included."""
        check_endpoint_calls(req, self.settings, self.llm_budget, client_address.get() or "")
        expansions: list[str] = []
        method = rewrite_expansion(req)
        if method is not None and req.expansion is not None:
            assert req.query is not None  # the schema requires a query with expansion
            expansions = await self.expansion_sources.paraphrases(req.query, method.source, req.expansion.n, "expansion.method")
        paraphrases: list[str] = []
        if req.consistency:
            c = req.consistency
            if c.paraphrases:
                paraphrases = list(c.paraphrases)
            else:
                assert req.query is not None and c.auto is not None
                paraphrases = await self.expansion_sources.paraphrases(req.query, c.method, c.auto, "consistency.method",
                                                                       usual_only=False)
            self._check_lengths((f"consistency.paraphrases.{i}", p) for i, p in enumerate(paraphrases))
        return QueryTexts(req.query, expansions, paraphrases, [t.text for t in req.terms or []])
