"""Search logic of the service: embeddings (cached, micro-batched), expansion, multi-term queries,
consistency reports, and the encoder/snapshot pair that reindex and reload swap atomically."""

from __future__ import annotations

import asyncio
import base64
import functools
import hashlib
import logging
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Awaitable, Callable, TypeVar

import numpy as np

from paraseek.core.encoder import Encoder, choose_providers, l2_normalize
from paraseek.core.errors import UserError
from paraseek.core.images import ImageDecodeError, decode_image
from paraseek.core.memory import limit_malloc_arenas, release_free_memory
from paraseek.core.query_vectors import close_to_query, mean_fusion, rocchio, weighted_fusion
from paraseek.core.rank_metrics import average_overlap, jaccard_at_k
from paraseek.core.settings import Settings
from paraseek.index.backends import store_from_settings
from paraseek.index.faiss_index import set_threads
from paraseek.index.filters import FilterError, SearchFilter
from paraseek.index.store import SearchableSnapshot, SearchView, SnapshotStore
from paraseek.index.versions import SnapshotError
from paraseek.paraphrase import ParaphraseSource, ParaphraseSourceUnavailable
from paraseek.paraphrase.caption_bank import CaptionBank, CaptionBankError, bank_dir
from paraseek.paraphrase.factory import make_source
from paraseek.paraphrase.llm import LLMError
from paraseek.service.batcher import ContinuousBatcher, LoneCallGate, Overloaded, encode_texts, search_rows
from paraseek.service.cache import Cache, params_key
from paraseek.service.prometheus import ServiceMetrics
from paraseek.service.schemas import (
    TEXT_EXPANSIONS,
    ConsistencyReport,
    EmbeddingsRequest,
    Expansion,
    ParaphraseReport,
    Result,
    SearchRequest,
    SearchResponse,
    Timings,
)

log = logging.getLogger(__name__)
T = TypeVar("T")
RRF_K = 60  # the usual reciprocal-rank-fusion constant
RETRY_LOAD_S = 5.0  # a service that could not load its index at start tries again this often
# an encoder call of at most this many texts runs on every core when its request is the only one in
# flight: it carries 1 text, or 4 with a consistency report
SOLO_MAX_TEXTS = 4


class StaleSwap(RuntimeError):
    """What a swap meant to replace is no longer what is served (-> 409, or a failed job)."""


class RequestError(UserError):
    """A well-formed request that cannot be answered as asked (-> 4xx naming ``field``)."""

    def __init__(self, field: str, message: str, status: int = 422):
        super().__init__(message)
        self.field = field
        self.status = status


@dataclass(frozen=True)
class Active:
    """What a request searches with. Replaced as one object, so a request never sees an encoder
    from one reindex and a snapshot from another."""

    encoder: Encoder
    snapshot: SearchableSnapshot

    @property
    def model_id(self) -> str:
        e = self.encoder
        return f"{e.name}:{e.version}:{e.precision}"


def encoder_workers(settings: Settings) -> int:
    """Encoder calls run at once: PARASEEK_ENCODER_WORKERS, default 2 where there are 2+ cores."""
    return settings.encoder_workers or min(2, os.cpu_count() or 1)


def default_text_batch(encoder: Encoder) -> int:
    """Texts per encoder call unless PARASEEK_MAX_BATCH_SIZE says otherwise. On CPU a text costs about
    the same at any batch size (MiniLM int8, one thread: 3.5 ms alone, 3.0 in 8s, 4.0 in 32s), so
    small calls shared among the workers keep every core busy; a GPU wants large ones."""
    return 8 if encoder.providers == ["CPUExecutionProvider"] else 64


def load_encoder(bundle, settings: Settings, precision: str | None = None) -> Encoder:
    """Every encoder the service runs (startup, reload, reindex) is built here from the settings. Its
    intra-op threads default to the cores shared out among the encoder workers (2 cores, 2 workers:
    one each; two single-threaded calls side by side encode ~1.4x more than one call on two threads).
    On CPU, fewer threads than cores also get a second text session on every core (PARASEEK_ENCODER_SOLO)
    for calls that run alone (see ``LoneCallGate``)."""
    cores = os.cpu_count() or 1
    threads = settings.encoder_threads or max(1, cores // encoder_workers(settings))
    solo = settings.encoder_solo and threads < cores and choose_providers() == ["CPUExecutionProvider"]
    return Encoder(bundle, precision=precision or settings.precision, threads=threads, solo_threads=cores if solo else None,
                   spin=settings.encoder_spin, memory_arena=False)


def load_snapshot(store: SnapshotStore, encoder: Encoder, settings: Settings, version: str | None = None) -> SearchableSnapshot:
    """A version of the configured index backend (default: the current one), checked against the encoder."""
    return store.load(version, image_space=encoder.image_space, threads=settings.faiss_threads)


def load_active(bundle, store: SnapshotStore, settings: Settings, precision: str | None = None) -> Active:
    encoder = load_encoder(bundle, settings, precision)
    return Active(encoder, load_snapshot(store, encoder, settings))


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
        self.metrics.in_flight.set(self.in_flight)
        try:
            return await asyncio.wait_for(method(self, *args, **kwargs), self.settings.request_timeout_s)
        except asyncio.TimeoutError:
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
class SearchTexts:
    """Every text of one request, in the order they are embedded together."""

    query: str | None
    expansions: list[str]
    paraphrases: list[str]
    terms: list[str]

    def all(self) -> list[str]:
        return ([self.query] if self.query is not None else []) + self.expansions + self.paraphrases + self.terms


@dataclass
class SearchVectors:
    query: np.ndarray | None
    expansions: np.ndarray
    paraphrases: np.ndarray
    terms: np.ndarray

    @classmethod
    def split(cls, texts: SearchTexts, vectors: np.ndarray) -> SearchVectors:
        q = 1 if texts.query is not None else 0
        e, p = q + len(texts.expansions), q + len(texts.expansions) + len(texts.paraphrases)
        return cls(vectors[0] if q else None, vectors[q:e], vectors[e:p], vectors[p:])


@dataclass
class SearchRows:
    """The vectors searched in one index call and where each part of the request sits among them."""

    matrix: np.ndarray
    fused: int  # rows [0, fused) are fused into the result list (1 unless rrf)
    plain_query: int  # the plain query's row (consistency compares it with the paraphrases)
    paraphrases: int  # first paraphrase row


@dataclass
class CachedTexts:
    """A request's texts, distinct ones once, with the vectors the cache has; ``missing`` are to encode."""

    texts: list[str]
    unique: list[str]
    found: dict[str, np.ndarray]
    missing: list[str]
    fingerprints: dict[str, str]  # text -> its cache key (empty with the cache off)
    truncation: dict[str, bool]  # text -> truncated, known from the same tokenisation

    @property
    def missing_fingerprints(self) -> list[str]:
        return [self.fingerprints.get(t, "") for t in self.missing]  # empty with the cache off: nothing is stored

    def assemble(self, encoder: Encoder, vectors: np.ndarray | None, flags: list[bool]) -> tuple[np.ndarray, list[bool]]:
        """Rows for ``texts`` and whether each was truncated, given the missing ones' vectors and flags."""
        found = dict(self.found)
        truncated: dict[str, bool] = {}
        if vectors is not None:
            for t, v, f in zip(self.missing, vectors, flags):
                found[t], truncated[t] = v, f
        # a cached vector does not say whether its text was truncated: the lookup's tokenisation did
        hits = [t for t in self.unique if t not in truncated]
        unknown = [t for t in hits if t not in self.truncation]
        truncated.update((t, self.truncation[t]) for t in hits if t in self.truncation)
        if unknown:
            truncated.update(zip(unknown, encoder.tokenizer.is_truncated(unknown)))
        return np.stack([found[t] for t in self.texts]), [truncated[t] for t in self.texts]


@dataclass
class Searched:
    """What the encoder and index stages give the rest of a search."""

    truncated: list[bool]
    rows: SearchRows
    scores: np.ndarray
    ids: np.ndarray
    t_enc: float  # when the vectors to search were ready
    neighbour_texts: list[str] = field(default_factory=list)  # the caption bank's captions (bank expansion)


class SearchEngine:
    def __init__(self, settings: Settings, metrics: ServiceMetrics):
        self.settings = settings
        self.metrics = metrics
        self.active: Active | None = None
        self.cache = Cache(
            metrics, settings.redis_url, timeout_s=settings.redis_timeout_s,
            connect_timeout_s=settings.redis_connect_timeout_s, retry_after_s=settings.redis_retry_after_s,
            failures_to_open=settings.redis_failures_to_open, embedding_ttl_s=settings.embedding_ttl_s,
            result_ttl_s=settings.result_ttl_s, lru_size=settings.lru_size,
        )
        # the request pipeline: texts -> encoder batch -> index batch -> results; each stage merges
        # concurrent requests into one call on its own thread
        self.batcher: ContinuousBatcher = ContinuousBatcher(
            encode_texts(self._encode), name="encoder", max_batch_size=settings.max_batch_size or 64,
            max_wait_ms=settings.max_wait_ms, enabled=settings.batching, size=len, on_batch=metrics.batch_size.observe,
            workers=encoder_workers(settings), max_queued=settings.max_queued_batches,
        )
        self.index_batcher: ContinuousBatcher = ContinuousBatcher(
            search_rows(self._search_snapshot), name="index", max_batch_size=settings.max_index_batch_size,
            enabled=settings.batching, size=lambda payload: len(payload[0]), on_batch=metrics.index_batch_size.observe,
            max_expect_wait_ms=settings.max_index_wait_ms, max_queued=settings.max_queued_batches,
        )
        # paraphrase sources (an LLM endpoint: seconds a call) on threads of their own, so that slow
        # ones never hold the shared pool that metadata lookups and filters use
        self._paraphrase_pool = ThreadPoolExecutor(settings.paraphrase_workers, thread_name_prefix="paraphrase")
        self._lone_calls = LoneCallGate()
        self.in_flight = 0  # requests being answered (search, image, similar, embeddings)
        self._sources: dict[str, ParaphraseSource] = {}
        self._banks: dict[str, CaptionBank] = {}
        self.default_expansion = (Expansion.model_validate_json(settings.default_expansion)
                                  if settings.default_expansion else None)
        self._sources_lock = threading.Lock()
        self._swap_lock = threading.Lock()  # swaps come from the event loop, reindex jobs and the watcher
        self.load_error: str | None = None
        self.store: SnapshotStore | None = None

    # -- lifecycle ---------------------------------------------------------------------------
    async def start(self) -> None:
        limit_malloc_arenas()
        await self.batcher.start()
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
        # warm WordNet (and the caption bank of a default bank expansion) in the background so the
        # first request that needs them does not pay for it; /readyz says "warming up" until then
        self._preload = asyncio.create_task(asyncio.to_thread(self._warm_up), name="warm-up")

    @property
    def warm(self) -> bool:
        preload = getattr(self, "_preload", None)
        return preload is not None and preload.done()

    def _warm_up(self) -> None:
        try:
            self.paraphrase_source("wordnet", "expansion.method")
        except RequestError:
            pass  # not installed: requests that ask for it get a 400
        active = self.active
        if active is not None and self.default_expansion is not None and self.default_expansion.method == "bank":
            try:
                self.caption_bank(active)
            except RequestError as exc:
                log.warning("default expansion 'bank' unavailable: %s", exc)

    async def stop(self) -> None:
        if getattr(self, "_watcher", None) is not None:
            self._watcher.cancel()
        await self.batcher.stop()
        await self.index_batcher.stop()
        self._paraphrase_pool.shutdown(wait=False, cancel_futures=True)
        await self.cache.close()

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
                    snap = await asyncio.to_thread(load_snapshot, self.store, active.encoder, self.settings)
                    self.swap(Active(active.encoder, snap), replaces=active)  # StaleSwap: the next poll looks again
                    log.info("now serving snapshot %s (current changed)", version)
            except Exception as exc:  # keep serving what we have
                log.warning("snapshot not loaded: %s: %s", type(exc).__name__, exc)

    def swap(self, active: Active, replaces: Active | None, publish: Callable[[], None] | None = None) -> None:
        """Serve ``active`` in place of ``replaces``, the one the caller read before its slow work
        (loading a bundle, building a version). When another swap came in between, nothing changes and
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
        self.batcher.max_batch_size = self.settings.max_batch_size or default_text_batch(active.encoder)
        self.metrics.index_size.set(len(active.snapshot))
        if replaces is not None and replaces is not active:
            release_free_memory()  # the replaced encoder/index: back to the OS, not just to the heap

    @property
    def ready(self) -> bool:
        return self.active is not None

    def require_active(self) -> Active:
        if self.active is None:
            raise RequestError("service", f"not ready: {self.load_error or 'loading'}", status=503)
        return self.active

    # -- paraphrase sources ----------------------------------------------------------------------
    def paraphrase_source(self, method: str, field: str, usual_only: bool = True) -> ParaphraseSource:
        """``usual_only``: expansion rewrites toward more usual wording (which raises consistency); a
        consistency report asks for every reliable rephrasing instead (it tests the answers' stability)."""
        key = f"{method}:{usual_only}"
        with self._sources_lock:
            if key not in self._sources:
                try:
                    self._sources[key] = make_source(method, self.settings, usual_only=usual_only)
                except ParaphraseSourceUnavailable as exc:
                    raise RequestError(field, f"{method} is unavailable: {exc}", status=400) from exc
            return self._sources[key]

    async def paraphrases(self, text: str, method: str, n: int, field: str, usual_only: bool = True) -> list[str]:
        loop = asyncio.get_running_loop()
        # loading a source reads files (WordNet takes seconds): never on the event loop
        source = await loop.run_in_executor(self._paraphrase_pool, self.paraphrase_source, method, field, usual_only)
        try:
            # LLM calls block on the network (each text's within PARASEEK_LLM_DEADLINE_S): off the event loop
            return await loop.run_in_executor(self._paraphrase_pool, source.paraphrases, text, n)
        except LLMError as exc:
            raise RequestError(field, str(exc), status=502) from exc
        except Exception as exc:  # a source's own failure: logged in full, reported as upstream, never a 500
            log.exception("paraphrase source %s failed", method)
            raise RequestError(field, f"{method} failed: {type(exc).__name__}: {exc}", status=502) from exc

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
            return encoder.encode_text_detailed(texts, batch_size=max(len(texts), 1), solo=solo)

    async def _cached_texts(self, active: Active, texts: list[str]) -> CachedTexts:
        unique = list(dict.fromkeys(texts))
        keyed = active.encoder.tokenizer.fingerprints_and_truncation(unique) if self.cache.backend != "off" else []
        fingerprints = {t: f for t, (f, _) in zip(unique, keyed)}
        cached = await self.cache.get_embeddings(active.model_id, [fingerprints.get(t, "") for t in unique])
        found = {t: v for t, v in zip(unique, cached) if v is not None}
        return CachedTexts(texts, unique, found, [t for t in unique if t not in found], fingerprints,
                           {t: cut for t, (_, cut) in zip(unique, keyed)})

    async def embed(self, active: Active, texts: list[str]) -> tuple[np.ndarray, list[bool]]:
        """Rows for ``texts`` (deduplicated), from the cache where possible, the rest in one call."""
        lookup = await self._cached_texts(active, texts)
        if not lookup.missing:
            return lookup.assemble(active.encoder, None, [])
        vectors, flags = await self.batcher.submit(active.encoder, lookup.missing)
        await self.cache.put_embeddings(active.model_id, lookup.missing_fingerprints, vectors)
        return lookup.assemble(active.encoder, vectors, flags)

    # -- search --------------------------------------------------------------------------------
    @staticmethod
    def _result(rows: dict[int, dict], image_id: int, score: float, rank: int) -> Result:
        row = rows.get(int(image_id), {})
        return Result(
            id=int(image_id), score=float(score), rank=rank, path=row.get("path"),
            url=row.get("url") or row.get("coco_url") or row.get("flickr_url"), captions=row.get("captions", []),
            licence=row.get("license"),
        )

    def effective_expansion(self, req: SearchRequest) -> SearchRequest:
        """The request with the server's default expansion applied when it names none; an explicit
        ``{"method": "none"}`` opts out."""
        if req.expansion is not None:
            return req if req.expansion.method != "none" else req.model_copy(update={"expansion": None})
        if self.default_expansion is None or req.query is None or req.terms:
            return req
        return req.model_copy(update={"expansion": self.default_expansion})

    def caption_bank(self, active: Active) -> CaptionBank:
        """The bank of the serving bundle: ``PARASEEK_CAPTION_BANK``, else the bundle's default bank
        under PARASEEK_HOME; 400 when there is none."""
        with self._sources_lock:
            bank = self._banks.get(active.model_id)
            if bank is None:
                encoder = active.encoder
                path = self.settings.caption_bank or bank_dir(self.settings.home, encoder.manifest)
                if not (path / "manifest.json").is_file():
                    raise RequestError("expansion.method", "no caption bank for this bundle: build one with "
                                       "`paraseek models build-bank` (or set PARASEEK_CAPTION_BANK)", status=400)
                try:
                    bank = CaptionBank.load(path, encoder)
                except CaptionBankError as exc:
                    raise RequestError("expansion.method", f"caption bank unavailable: {exc}", status=400) from exc
                self._banks = {active.model_id: bank}  # one bundle serves at a time
            return bank

    async def _expand_vectors(self, active: Active, view: SearchView, exp: Expansion,
                              queries: np.ndarray) -> tuple[np.ndarray, list[str]]:
        """Stage 2a, vector expansions of a batch of query vectors: the caption bank's nearest
        captions, or pseudo-relevance feedback from each vector's top images. Also the bank captions
        used for the first row (shown as ``expansions``)."""
        if exp.method == "bank":
            bank = self._banks.get(active.model_id)
            if bank is None:  # first use: loading reads files, off the event loop
                bank = await asyncio.to_thread(self.caption_bank, active)
            rows, sims = await self.index_batcher.submit(bank, (queries, exp.n), _BANK_NEIGHBOURS)
            fused = (mean_fusion(queries, bank.vectors[rows]) if exp.fusion == "mean"
                     else weighted_fusion(queries, bank.vectors[rows], sims))
            return fused, bank.texts_of(rows[0])
        _, top = await self.index_batcher.submit(view, (queries, exp.m))
        feedback = await asyncio.to_thread(active.snapshot.feedback_vectors, top)
        return rocchio(queries, feedback, exp.alpha, exp.beta), []

    @counted
    async def search(self, req: SearchRequest) -> dict:
        """The response as a JSON-ready dict (the route returns it without re-validating it).

        Stages: texts (query, expansions, paraphrases, terms) -> one embedding call -> the vectors to
        search -> one index call -> results fused into a list -> consistency report."""
        t0 = time.perf_counter()
        active = self.require_active()
        self._check_lengths(req)
        req = self.effective_expansion(req)
        key = params_key({"snapshot": active.snapshot.version, "model": active.model_id, "request": req.model_dump()})
        hit = await self._cached(key, t0)
        if hit is not None:
            return hit

        view = await self.view(active.snapshot, req.filter)
        texts = await self._texts(req)  # paraphrase sources may take seconds: before the encoder call
        k_search = max(req.offset + req.k, req.consistency.k if req.consistency else 0)
        if self._runs_alone(req, texts):
            searched = await self._encode_and_search_alone(active, view, req, texts, k_search)
        else:
            searched = await self._encode_then_search(active, view, req, texts, k_search)
        t_enc, t_search = searched.t_enc, time.perf_counter()
        self.metrics.stage.labels("encode").observe(t_enc - t0)
        self.metrics.stage.labels("search").observe(t_search - t_enc)

        ranked = self._fuse(req.k, req.offset, searched.scores, searched.ids, searched.rows.fused)
        results = await self._results(active.snapshot, ranked)
        report = (self._consistency_report(req, texts.paraphrases, searched.ids, searched.rows)
                  if texts.paraphrases else None)
        response = SearchResponse(
            results=results, bundle=active.encoder.name, bundle_version=active.encoder.version,
            snapshot_version=active.snapshot.version,
            timings=Timings(encode_ms=(t_enc - t0) * 1000, search_ms=(t_search - t_enc) * 1000,
                            total_ms=(time.perf_counter() - t0) * 1000),
            cache="miss" if self.cache.backend != "off" else "off",
            truncated=bool(searched.truncated[0]) if req.query is not None else any(searched.truncated),
            expansions=(texts.expansions or searched.neighbour_texts) or None, consistency=report,
        )
        body = response.model_dump(mode="json", exclude_none=True)
        await self.cache.put_result(key, body)
        return body

    def _runs_alone(self, req: SearchRequest, texts: SearchTexts) -> bool:
        """The service's only request in flight, with few texts and no index lookup between encoding
        and search (bank and prf expansions make one)."""
        vector_expansion = req.expansion is not None and req.expansion.method in ("bank", "prf")
        return self.in_flight == 1 and not vector_expansion and len(texts.all()) <= SOLO_MAX_TEXTS

    async def _encode_and_search_alone(self, active: Active, view: SearchView, req: SearchRequest, texts: SearchTexts,
                                       k: int) -> Searched:
        """Encoder call and index search as one call on the index's thread (one search at a time still):
        at low load this saves the round trip through the event loop between the two stages (about 0.6 ms
        per request on 2 cores), and nothing else is waiting to be merged with it."""
        lookup = await self._cached_texts(active, texts.all())

        def encode_and_search() -> tuple[np.ndarray | None, Searched]:
            vectors, flags = self._encode(active.encoder, lookup.missing) if lookup.missing else (None, [])
            embedded, truncated = lookup.assemble(active.encoder, vectors, flags)
            t_enc = time.perf_counter()
            rows = self._search_rows(req, self._query_vectors(req, texts, embedded))
            scores, ids = self._search_snapshot(view, rows.matrix, k, alone=True)
            return vectors, Searched(truncated, rows, scores, ids, t_enc)

        if lookup.missing:
            self.metrics.batch_size.observe(len(lookup.missing))
        vectors, searched = await self.index_batcher.run_alone(encode_and_search)
        self.metrics.index_batch_size.observe(len(searched.rows.matrix))
        if vectors is not None:
            await self.cache.put_embeddings(active.model_id, lookup.missing_fingerprints, vectors)
        return searched

    async def _encode_then_search(self, active: Active, view: SearchView, req: SearchRequest, texts: SearchTexts,
                                  k: int) -> Searched:
        """The pipeline's two stages, each merging concurrent requests into one call."""
        # announced to the index stage from encoding until its rows get there: a search that would
        # start alone waits for them instead (an exact scan costs nearly the same for one row as for many)
        with self.index_batcher.expect() as expected:
            embedded, truncated = await self.embed(active, texts.all())
            vectors = self._query_vectors(req, texts, embedded)
            expanded: np.ndarray | None = None
            neighbour_texts: list[str] = []
            if req.expansion is not None and req.expansion.method in ("bank", "prf") and vectors.query is not None:
                # the paraphrases of a consistency report go through the same expansion as the query, so the
                # report measures what is served
                expected.release()  # its own index lookup goes first: nothing may wait for this request meanwhile
                batch, neighbour_texts = await self._expand_vectors(active, view, req.expansion,
                                                                    np.vstack([vectors.query[None], vectors.paraphrases]))
                expanded, vectors.paraphrases = batch[0], batch[1:]
            t_enc = time.perf_counter()
            rows = self._search_rows(req, vectors, expanded, compare_expanded=expanded is not None)
            scores, ids = await self.index_batcher.submit(view, (rows.matrix, k), expected=expected)
        return Searched(truncated, rows, scores, ids, t_enc, neighbour_texts)

    @staticmethod
    def _query_vectors(req: SearchRequest, texts: SearchTexts, embedded: np.ndarray) -> SearchVectors:
        """The request's vectors by role; expansions too far from the query (``min_cos``) are dropped,
        from ``texts`` as well."""
        vectors = SearchVectors.split(texts, embedded)
        if req.expansion is not None and req.expansion.min_cos > -1 and len(vectors.expansions):
            assert vectors.query is not None
            keep = close_to_query(vectors.query, vectors.expansions, req.expansion.min_cos)
            vectors.expansions = vectors.expansions[keep]
            texts.expansions = [t for t, k in zip(texts.expansions, keep) if k]
        return vectors

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
        vector = await self.batcher.run_alone(encoder.encode_pixels, pixels[None])
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
        snap = active.snapshot
        scores, ids = await self.index_batcher.submit(view, (vector, offset + k + (exclude is not None)))
        t_search = time.perf_counter()
        self.metrics.stage.labels("search").observe(t_search - t_enc)
        response = SearchResponse(
            results=await self._results(snap, self._page(ids[0], scores[0], k, offset, exclude)), bundle=active.encoder.name,
            bundle_version=active.encoder.version, snapshot_version=snap.version,
            timings=Timings(encode_ms=(t_enc - t0) * 1000, search_ms=(t_search - t_enc) * 1000,
                            total_ms=(time.perf_counter() - t0) * 1000),
            cache="miss" if self.cache.backend != "off" else "off",
        )
        body = response.model_dump(mode="json", exclude_none=True)
        await self.cache.put_result(key, body)
        return body

    # -- OpenAI-compatible embeddings -------------------------------------------------------------
    @counted
    async def embeddings(self, req: EmbeddingsRequest) -> dict:
        """Text embeddings by the served text tower, through the same cache and micro-batcher as search."""
        active = self.require_active()
        e = active.encoder
        if req.model not in (e.name, f"{e.name}:{e.version}"):
            raise RequestError("model", f"model {req.model!r} is not served here; this service serves {e.name!r}", status=404)
        if req.dimensions is not None and req.dimensions != e.dim:
            raise RequestError("dimensions", f"{e.name} embeds into {e.dim} dimensions, not {req.dimensions}")
        texts = req.input
        if len(texts) > self.settings.max_embedding_inputs:
            raise RequestError("input", f"at most {self.settings.max_embedding_inputs} texts per call")
        for i, text in enumerate(texts):
            if len(text) > self.settings.max_query_chars:
                raise RequestError(f"input.{i}", f"text is longer than {self.settings.max_query_chars} characters")
        vectors, _ = await self.embed(active, texts)
        tokens = int(e.tokenize(texts).attention_mask.sum())
        if req.encoding_format == "base64":  # what OpenAI's clients decode: little-endian float32 bytes
            encoded: list = [base64.b64encode(np.asarray(v, "<f4").tobytes()).decode("ascii") for v in vectors]
        else:
            encoded = np.asarray(vectors, np.float32).tolist()
        return {"object": "list", "model": e.name, "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
                "data": [{"object": "embedding", "index": i, "embedding": v} for i, v in enumerate(encoded)]}

    def _check_lengths(self, req: SearchRequest) -> None:
        limit = self.settings.max_query_chars
        if req.query is not None and len(req.query) > limit:
            raise RequestError("query", f"query is longer than {limit} characters")
        for i, term in enumerate(req.terms or []):
            if len(term.text) > limit:
                raise RequestError(f"terms.{i}.text", f"term is longer than {limit} characters")

    async def _texts(self, req: SearchRequest) -> SearchTexts:
        """Stage 1: every text of the request, generated ones included."""
        expansions: list[str] = []
        if req.expansion and req.expansion.method in TEXT_EXPANSIONS:
            assert req.query is not None  # the schema requires a query with expansion
            expansions = await self.paraphrases(req.query, req.expansion.method, req.expansion.n, "expansion.method")
        paraphrases: list[str] = []
        if req.consistency:
            c = req.consistency
            if c.paraphrases:
                paraphrases = list(c.paraphrases)
            else:
                assert req.query is not None and c.auto is not None
                paraphrases = await self.paraphrases(req.query, c.method, c.auto, "consistency.method", usual_only=False)
            for i, p in enumerate(paraphrases):
                if len(p) > self.settings.max_query_chars:
                    raise RequestError(f"consistency.paraphrases.{i}", "paraphrase is too long")
        return SearchTexts(req.query, expansions, paraphrases, [t.text for t in req.terms or []])

    @staticmethod
    def _search_rows(req: SearchRequest, v: SearchVectors, expanded: np.ndarray | None = None,
                     compare_expanded: bool = False) -> SearchRows:
        """Stage 2: the vectors to search. Terms: their weighted sum (+ the query); a vector expansion
        (bank, prf) as computed; text expansion with mean fusion: Cheng et al. eq. 5; rrf: the query
        and each expansion searched separately."""
        if req.terms:
            combined = sum((t.weight * vec for t, vec in zip(req.terms, v.terms)), np.zeros_like(v.terms[0]))
            if v.query is not None:
                combined = combined + v.query
            if np.linalg.norm(combined) < 1e-6:
                raise RequestError("terms", "the weighted terms cancel out (zero vector)")
            main = l2_normalize(combined)
        elif expanded is not None:
            main = expanded
        elif len(v.expansions) and req.expansion is not None and req.expansion.fusion == "mean":
            assert v.query is not None
            main = mean_fusion(v.query, v.expansions)
        else:
            assert v.query is not None
            main = v.query
        rows = [main]
        rrf = len(v.expansions) > 0 and req.expansion is not None and req.expansion.fusion == "rrf" and not req.terms
        if rrf:
            rows.extend(v.expansions)
        fused = len(rows)
        plain_query = 0
        if len(v.paraphrases):
            if main is not v.query and not compare_expanded:
                assert v.query is not None
                plain_query = len(rows)
                rows.append(v.query)  # consistency compares the plain query with its paraphrases
            first_paraphrase = len(rows)
            rows.extend(v.paraphrases)
        else:
            first_paraphrase = len(rows)
        return SearchRows(np.vstack(rows), fused, plain_query, first_paraphrase)

    def _fuse(self, k: int, offset: int, scores: np.ndarray, ids: np.ndarray, fused: int) -> list[tuple[int, float, int]]:
        """Stage 3: the result list, ranks offset+1 .. offset+k; several fused rows are combined by
        reciprocal rank."""
        if fused > 1:
            ranks: dict[int, float] = {}
            for row in ids[:fused]:
                for rank, i in enumerate(row[row >= 0]):
                    ranks[int(i)] = ranks.get(int(i), 0.0) + 1.0 / (RRF_K + rank + 1)
            ranked = sorted(ranks.items(), key=lambda kv: -kv[1])
            return self._page([i for i, _ in ranked], [s for _, s in ranked], k, offset)
        return self._page(ids[0], scores[0], k, offset)

    @staticmethod
    def _page(ids, scores, k: int, offset: int, exclude: int | None = None) -> list[tuple[int, float, int]]:
        """(id, score, rank) of ranks offset+1 .. offset+k."""
        kept = [(int(i), float(s)) for i, s in zip(ids, scores) if i >= 0 and i != exclude]
        return [(i, s, offset + r + 1) for r, (i, s) in enumerate(kept[offset : offset + k])]

    async def _results(self, snap: SearchableSnapshot, page: list[tuple[int, float, int]]) -> list[Result]:
        rows = await self.metadata(snap, [i for i, _, _ in page])
        return [self._result(rows, i, s, rank) for i, s, rank in page]

    def _consistency_report(self, req: SearchRequest, paraphrases: list[str], ids: np.ndarray,
                            rows: SearchRows) -> ConsistencyReport:
        """Stage 4: AO@k and JS@k of each paraphrase's list against the plain query's."""
        assert req.consistency is not None
        kc = req.consistency.k
        qlist = [int(i) for i in ids[rows.plain_query][:kc] if i >= 0]
        reports = []
        for text, row in zip(paraphrases, ids[rows.paraphrases : rows.paraphrases + len(paraphrases)]):
            plist = [int(i) for i in row[:kc] if i >= 0]
            reports.append(ParaphraseReport(text=text, ids=plist, ao=average_overlap(qlist, plist, kc),
                                            js=jaccard_at_k(qlist, plist, kc)))
        mean_ao = float(np.mean([r.ao for r in reports]))
        threshold = self.settings.consistency_threshold
        c = req.consistency
        requested = len(c.paraphrases) if c.paraphrases else (c.auto or 0)
        exp = req.expansion
        compared_under = exp.method if exp is not None and exp.method in ("bank", "prf") else None
        return ConsistencyReport(k=kc, ids=qlist, requested=requested, produced=len(reports), expansion=compared_under,
                                 paraphrases=reports, mean_ao=mean_ao,
                                 mean_js=float(np.mean([r.js for r in reports])), stable=mean_ao >= threshold,
                                 threshold=threshold)


# the caption bank's nearest captions, merged across requests like index searches: (rows, similarities)
_BANK_NEIGHBOURS = search_rows(lambda bank, queries, n: bank.neighbours(queries, n))


def validate_snapshot(active: Active) -> None:
    """A new snapshot must load and answer a query before it replaces the serving one."""
    vec = active.encoder.encode_text(["a photo"])
    _, ids = active.snapshot.search_ids(vec, 1)
    if len(active.snapshot) and ids[0][0] < 0:
        raise SnapshotError("the new snapshot returned no result for a test query")
