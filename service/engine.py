"""Search logic of the service: embeddings (cached, micro-batched), expansion, multi-term queries,
consistency reports, and the encoder/snapshot pair that reindex and reload swap atomically."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from dataclasses import dataclass

import numpy as np

from index.snapshot import Snapshot, SnapshotError
from paraseek.encoder import Encoder, l2_normalize
from paraseek.metrics import average_overlap, jaccard_at_k
from paraseek.paraphrase import ParaphraseSource, SourceUnavailable
from service.batcher import MicroBatcher
from service.cache import Cache, params_key
from service.metrics import ServiceMetrics
from service.schemas import (
    ConsistencyReport,
    ParaphraseReport,
    Result,
    SearchRequest,
    SearchResponse,
    Timings,
)
from service.settings import Settings

log = logging.getLogger(__name__)
RRF_K = 60  # the usual reciprocal-rank-fusion constant


class RequestError(ValueError):
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
    snapshot: Snapshot

    @property
    def model_id(self) -> str:
        e = self.encoder
        return f"{e.name}:{e.version}:{e.precision}"


def load_active(bundle, snapshot, settings: Settings, precision: str | None = None) -> Active:
    encoder = Encoder(bundle, precision=precision or settings.precision, threads=settings.encoder_threads,
                      spin=settings.encoder_spin)
    snap = Snapshot.load(snapshot, image_space=encoder.image_space, threads=settings.faiss_threads)
    return Active(encoder, snap)


class SearchEngine:
    def __init__(self, settings: Settings, metrics: ServiceMetrics):
        self.settings = settings
        self.metrics = metrics
        self.active: Active | None = None
        self.cache = Cache(
            metrics, settings.redis_url, timeout_s=settings.redis_timeout_s,
            retry_after_s=settings.redis_retry_after_s, embedding_ttl_s=settings.embedding_ttl_s,
            result_ttl_s=settings.result_ttl_s, lru_size=settings.lru_size,
        )
        self.batcher = MicroBatcher(
            self._encode, max_batch_size=settings.max_batch_size, max_wait_ms=settings.max_wait_ms,
            enabled=settings.batching, on_batch=metrics.batch_size.observe,
        )
        self._sources: dict[str, ParaphraseSource] = {}
        self._sources_lock = threading.Lock()
        self.load_error: str | None = None

    # -- lifecycle ---------------------------------------------------------------------------
    async def start(self) -> None:
        await self.batcher.start()
        try:
            self.swap(load_active(self.settings.bundle, self.settings.snapshot, self.settings))
        except Exception as exc:  # serve /healthz and report not ready, rather than crash-looping
            self.load_error = f"{type(exc).__name__}: {exc}"
            log.error("model or index not loaded: %s", self.load_error)
        if self.settings.snapshot_poll_s > 0:
            self._watcher = asyncio.create_task(self._watch_snapshot(), name="snapshot-watcher")
        # warm WordNet in the background so the first expansion request does not pay for it
        self._preload = asyncio.create_task(asyncio.to_thread(self._preload_wordnet), name="preload-wordnet")

    def _preload_wordnet(self) -> None:
        try:
            self.source("wordnet", "expansion.method")
        except RequestError:
            pass  # not installed: requests that ask for it get a 400

    async def stop(self) -> None:
        if getattr(self, "_watcher", None) is not None:
            self._watcher.cancel()
        await self.batcher.stop()
        await self.cache.close()

    async def _watch_snapshot(self) -> None:
        """Follow the snapshot root's ``current`` pointer (another replica's reindex, or a CLI build)."""
        from index.snapshot import current_version

        while True:
            await asyncio.sleep(self.settings.snapshot_poll_s)
            try:
                version = current_version(self.settings.snapshot)
                active = self.active
                if version and (active is None or version != active.snapshot.version):
                    encoder = active.encoder if active else None
                    if encoder is None:
                        new = await asyncio.to_thread(load_active, self.settings.bundle, self.settings.snapshot, self.settings)
                    else:
                        snap = await asyncio.to_thread(Snapshot.load, self.settings.snapshot,
                                                       image_space=encoder.image_space, threads=self.settings.faiss_threads)
                        new = Active(encoder, snap)
                    self.swap(new)
                    log.info("now serving snapshot %s (current changed)", version)
            except Exception as exc:  # keep serving what we have
                log.warning("snapshot %s not loaded: %s", self.settings.snapshot, exc)

    def swap(self, active: Active) -> None:
        self.active = active  # one reference assignment: atomic for concurrent requests
        self.load_error = None
        self.metrics.index_size.set(len(active.snapshot))

    @property
    def ready(self) -> bool:
        return self.active is not None

    def require_active(self) -> Active:
        if self.active is None:
            raise RequestError("service", f"not ready: {self.load_error or 'loading'}", status=503)
        return self.active

    # -- sources -------------------------------------------------------------------------------
    def source(self, method: str, field: str) -> ParaphraseSource:
        with self._sources_lock:
            if method not in self._sources:
                s = self.settings
                try:
                    if method == "wordnet":
                        from paraseek.paraphrase.wordnet import WordNetSource

                        self._sources[method] = WordNetSource()
                    elif method == "ppdb":
                        from paraseek.paraphrase.ppdb import PPDBSource

                        self._sources[method] = PPDBSource(s.ppdb_path)
                    else:
                        from paraseek.paraphrase.llm import ChatClient, LLMSource, TwoStepGenerator

                        client = ChatClient(
                            s.llm_base_url, s.llm_model, s.llm_api_key.get_secret_value() if s.llm_api_key else None,
                            timeout=s.llm_timeout_s, retries=s.llm_retries, cache_path=s.llm_cache,
                        )
                        self._sources[method] = LLMSource(client) if method == "llm" else TwoStepGenerator(client)
                except SourceUnavailable as exc:
                    raise RequestError(field, f"{method} is unavailable: {exc}", status=400) from exc
            return self._sources[method]

    async def paraphrases(self, text: str, method: str, n: int, field: str) -> list[str]:
        # loading a source reads files (WordNet takes seconds): never on the event loop
        source = await asyncio.to_thread(self.source, method, field)
        from paraseek.paraphrase.llm import LLMError

        try:
            # LLM calls block on the network: keep them off the event loop
            return await asyncio.to_thread(source.paraphrases, text, n)
        except LLMError as exc:
            raise RequestError(field, str(exc), status=502) from exc
        except Exception as exc:  # a source's own failure: logged in full, reported as upstream, never a 500
            log.exception("paraphrase source %s failed", method)
            raise RequestError(field, f"{method} failed: {type(exc).__name__}: {exc}", status=502) from exc

    # -- embeddings ----------------------------------------------------------------------------
    @staticmethod
    def _encode(encoder: Encoder, texts: list[str]) -> tuple[np.ndarray, list[bool]]:
        return encoder.encode_text_detailed(texts, batch_size=max(len(texts), 1))

    async def embed(self, active: Active, texts: list[str]) -> tuple[np.ndarray, list[bool]]:
        """Rows for ``texts`` (deduplicated), from the cache where possible, the rest in one call."""
        unique = list(dict.fromkeys(texts))
        cached = await self.cache.get_embeddings(active.model_id, unique)
        missing = [t for t, v in zip(unique, cached) if v is None]
        found = {t: v for t, v in zip(unique, cached) if v is not None}
        truncated = {t: False for t in unique}
        if missing:
            vectors, flags = await self.batcher.submit(active.encoder, missing)
            for t, v, f in zip(missing, vectors, flags):
                found[t], truncated[t] = v, f
            await self.cache.put_embeddings(active.model_id, missing, vectors)
        encoded = set(missing)
        hits = [t for t in unique if t not in encoded]
        if hits:  # a cached vector does not say whether its text was truncated: the tokenizer does
            for t, flag in zip(hits, active.encoder.tokenizer.is_truncated(hits)):
                truncated[t] = flag
        return np.stack([found[t] for t in texts]), [truncated[t] for t in texts]

    # -- search --------------------------------------------------------------------------------
    def _result(self, snap: Snapshot, image_id: int, score: float, rank: int) -> Result:
        row = snap.metadata[int(image_id)]
        return Result(
            id=int(image_id), score=float(score), rank=rank, path=row["path"],
            url=row.get("coco_url") or row.get("flickr_url"), captions=row.get("captions", []),
            licence=row.get("license"),
        )

    async def search(self, req: SearchRequest) -> dict:
        """The response as a JSON-ready dict (the route returns it without re-validating it)."""
        t0 = time.perf_counter()
        active = self.require_active()
        snap = active.snapshot
        if req.query is not None and len(req.query) > self.settings.max_query_chars:
            raise RequestError("query", f"query is longer than {self.settings.max_query_chars} characters")
        for i, term in enumerate(req.terms or []):
            if len(term.text) > self.settings.max_query_chars:
                raise RequestError(f"terms.{i}.text", f"term is longer than {self.settings.max_query_chars} characters")
        key = params_key({"snapshot": snap.version, "model": active.model_id, "request": req.model_dump()})
        hit = await self.cache.get_result(key)
        if hit is not None:  # stored exactly as served: patch the per-request fields only
            hit["cache"] = "hit"
            hit["timings"] = {"encode_ms": 0.0, "search_ms": 0.0, "total_ms": (time.perf_counter() - t0) * 1000}
            return hit

        # 1. every text of the request, generated ones included, then one embedding call
        expansions: list[str] = []
        if req.expansion:
            expansions = await self.paraphrases(req.query, req.expansion.method, req.expansion.n, "expansion.method")
        paraphrases: list[str] = []
        if req.consistency:
            c = req.consistency
            paraphrases = list(c.paraphrases) if c.paraphrases else await self.paraphrases(
                req.query, c.method, c.auto, "consistency.method")
            for i, p in enumerate(paraphrases):
                if len(p) > self.settings.max_query_chars:
                    raise RequestError(f"consistency.paraphrases.{i}", "paraphrase is too long")
        texts = ([req.query] if req.query is not None else []) + expansions + paraphrases + [t.text for t in req.terms or []]
        vectors, truncated = await self.embed(active, texts)
        t_enc = time.perf_counter()
        self.metrics.stage.labels("encode").observe(t_enc - t0)

        # 2. the query vector(s)
        pos = 0
        query_vec = vectors[pos] if req.query is not None else None
        pos += 1 if req.query is not None else 0
        exp_vecs = vectors[pos : pos + len(expansions)]
        pos += len(expansions)
        para_vecs = vectors[pos : pos + len(paraphrases)]
        pos += len(paraphrases)
        term_vecs = vectors[pos:]
        rows: list[np.ndarray] = []
        if req.terms:
            combined = sum(t.weight * v for t, v in zip(req.terms, term_vecs))
            if query_vec is not None:
                combined = combined + query_vec
            if np.linalg.norm(combined) < 1e-6:
                raise RequestError("terms", "the weighted terms cancel out (zero vector)")
            main = l2_normalize(combined)
        elif expansions and req.expansion.fusion == "mean":
            # Cheng et al. eq. 5: mean of the normalised embeddings of the query and its expansions
            main = l2_normalize(np.mean(np.vstack([query_vec[None], exp_vecs]), axis=0))
        else:
            main = query_vec
        rows.append(main)
        rrf = bool(expansions) and req.expansion.fusion == "rrf" and not req.terms
        if rrf:
            rows.extend(exp_vecs)
        n_before_para = len(rows)
        plain_query_row = None
        if paraphrases:
            if main is not query_vec:
                plain_query_row = len(rows)
                rows.append(query_vec)  # consistency compares the plain query with its paraphrases
            rows.extend(para_vecs)
        k_search = max(req.k, req.consistency.k if req.consistency else 0)
        scores, ids = snap.search_ids(np.vstack(rows), k_search)
        t_search = time.perf_counter()
        self.metrics.stage.labels("search").observe(t_search - t_enc)

        # 3. results
        if rrf:
            fused: dict[int, float] = {}
            for row in ids[:n_before_para]:
                for rank, i in enumerate(row[row >= 0]):
                    fused[int(i)] = fused.get(int(i), 0.0) + 1.0 / (RRF_K + rank + 1)
            ranked = sorted(fused.items(), key=lambda kv: -kv[1])[: req.k]
            results = [self._result(snap, i, s, r + 1) for r, (i, s) in enumerate(ranked)]
        else:
            results = [self._result(snap, i, s, r + 1)
                       for r, (s, i) in enumerate(zip(scores[0][: req.k], ids[0][: req.k])) if i >= 0]

        report = None
        if paraphrases:
            kc = req.consistency.k
            qrow = ids[plain_query_row if plain_query_row is not None else 0][:kc]
            qlist = [int(i) for i in qrow if i >= 0]
            reports = []
            start = (plain_query_row + 1) if plain_query_row is not None else n_before_para
            for text, row in zip(paraphrases, ids[start : start + len(paraphrases)]):
                plist = [int(i) for i in row[:kc] if i >= 0]
                reports.append(ParaphraseReport(text=text, ids=plist, ao=average_overlap(qlist, plist, kc),
                                                js=jaccard_at_k(qlist, plist, kc)))
            mean_ao = float(np.mean([r.ao for r in reports]))
            report = ConsistencyReport(
                k=kc, paraphrases=reports, mean_ao=mean_ao, mean_js=float(np.mean([r.js for r in reports])),
                stable=mean_ao >= self.settings.consistency_threshold, threshold=self.settings.consistency_threshold,
            )

        total = (time.perf_counter() - t0) * 1000
        response = SearchResponse(
            results=results, bundle=active.encoder.name, bundle_version=active.encoder.version,
            snapshot_version=snap.version,
            timings=Timings(encode_ms=(t_enc - t0) * 1000, search_ms=(t_search - t_enc) * 1000, total_ms=total),
            cache="miss" if self.cache.backend != "off" else "off",
            truncated=bool(truncated[0]) if req.query is not None else any(truncated),
            expansions=expansions or None, consistency=report,
        )
        body = response.model_dump(mode="json", exclude_none=True)
        await self.cache.put_result(key, body)
        return body


def validate_snapshot(active: Active) -> None:
    """A new snapshot must load and answer a query before it replaces the serving one."""
    vec = active.encoder.encode_text(["a photo"])
    _, ids = active.snapshot.search_ids(vec, 1)
    if len(active.snapshot) and ids[0][0] < 0:
        raise SnapshotError("the new snapshot returned no result for a test query")
