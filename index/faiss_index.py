"""FAISS index types, their parameters, and CPU/GPU placement chosen at run time."""

from __future__ import annotations

import functools
import logging
import math
import os
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager, nullcontext
from typing import Callable, Literal

import faiss
import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from paraseek.core.errors import UserError
from paraseek.core.memory import available_memory_bytes
from paraseek.core.rank_metrics import overlap_recalls

log = logging.getLogger(__name__)

# Exact search is the default up to this many vectors. Beyond it `auto` picks an IVF index, not
# HNSW: at 1M x 512 (bench_index_1m.txt) IVF tuned to recall 0.95 searched 40-80x faster than exact,
# while an HNSW build at 2M x 384 on 2 cores took 60-100 s per 65K chunk (~45 min) and holds its whole
# graph in memory. ivf_fp16 (float16 lists, recall 0.956 at 53x) where its lists fit the memory
# budget, else ivf_pq with refine from the memory-mapped vectors (codes of dim/4 bytes per vector).
EXACT_LIMIT = 200_000
# what `auto` tunes an approximate index to when no --target-recall is given
AUTO_TARGET_RECALL = 0.95

IndexType = Literal["auto", "flat", "hnsw", "ivf_flat", "ivf_fp16", "ivf_pq"]
# inverted-file types: a coarse quantizer assigns vectors to nlist lists, a search scans nprobe of them
IVF_TYPES = ("ivf_flat", "ivf_fp16", "ivf_pq")


class IndexSpec(BaseModel):
    """Which FAISS index to build. Inner product on L2-normalised vectors = cosine similarity."""

    model_config = ConfigDict(extra="forbid")

    type: IndexType = "auto"
    hnsw_m: int = Field(32, ge=4, le=128)
    ef_construction: int = Field(200, ge=8)
    ef_search: int = Field(128, ge=1)
    nlist: int | None = Field(None, ge=1, description="IVF lists; default ~4*sqrt(N)")
    nprobe: int = Field(16, ge=1)
    pq_m: int | None = Field(None, ge=1, description="PQ sub-quantisers; default dim/4 (must divide dim)")
    pq_nbits: int = Field(8, ge=4, le=12)
    refine_factor: int | None = Field(
        None, ge=1, le=1000, description="re-rank k x this many candidates by their exact vectors (the snapshot's "
        "vectors.npy, memory-mapped): recovers the recall PQ codes lose; 1 = off; default 20 for ivf_pq, else 1")
    memory_gb: float | None = Field(
        None, gt=0, description="`auto` past the exact limit: the RAM the index's lists may take (ivf_fp16 if its "
        "float16 lists fit, else ivf_pq); default: half the memory available at build time")

    def resolved(self, count: int, dim: int) -> IndexSpec:
        """Fill in defaults that depend on the data size."""
        upd: dict = {}
        kind = self.type
        if kind == "auto":
            kind = auto_index_type(count, dim, self.memory_gb)
            upd["type"] = kind
        if kind in IVF_TYPES and self.nlist is None:
            # at least ~39 training points per list (FAISS' own rule of thumb)
            upd["nlist"] = int(max(1, min(4 * math.sqrt(count), count // 39)))
        if kind == "ivf_pq":
            m = self.pq_m or max(1, dim // 4)
            while dim % m:
                m -= 1
            upd["pq_m"] = m
            # each PQ codebook trains 2**nbits centroids on the vectors: shrink codes for small sets
            if count < 16:
                raise UserError(f"ivf_pq needs at least 16 vectors to train, the source has {count}: use flat")
            upd["pq_nbits"] = min(self.pq_nbits, int(math.log2(count)))
        if self.refine_factor is None:
            upd["refine_factor"] = 20 if kind == "ivf_pq" else 1
        return self.model_copy(update=upd)

    @property
    def exact(self) -> bool:
        return self.type == "flat"


def auto_index_type(count: int, dim: int, memory_gb: float | None = None) -> IndexType:
    """What ``auto`` builds for ``count`` vectors of ``dim``: exact up to ``EXACT_LIMIT``, then
    ivf_fp16 while its float16 lists fit ``memory_gb`` (default half the available memory), else ivf_pq."""
    if count <= EXACT_LIMIT:
        return "flat"
    budget = (memory_gb * 2**30) if memory_gb is not None else available_memory_bytes() / 2
    return "ivf_fp16" if count * dim * 2 <= budget else "ivf_pq"


def create_index(spec: IndexSpec, dim: int) -> faiss.Index:
    """An empty index that stores our stable int64 ids: IVF indexes keep them in their lists, flat and
    HNSW inside an ``IndexIDMap2`` (whose id map and reverse map cost 16-50 bytes a vector: 0.5 GB of
    private memory at 10M, for nothing an IVF index needs)."""
    base: faiss.Index
    nlist, pq_m = spec.nlist or 1, spec.pq_m or 1  # resolved() filled both for IVF types
    if spec.type == "flat":
        base = faiss.IndexFlatIP(dim)
    elif spec.type == "hnsw":
        base = faiss.IndexHNSWFlat(dim, spec.hnsw_m, faiss.METRIC_INNER_PRODUCT)
        base.hnsw.efConstruction = spec.ef_construction
        base.hnsw.efSearch = spec.ef_search
    elif spec.type in IVF_TYPES:
        quantizer = faiss.IndexFlatIP(dim)
        if spec.type == "ivf_flat":
            base = faiss.IndexIVFFlat(quantizer, dim, nlist, faiss.METRIC_INNER_PRODUCT)
        elif spec.type == "ivf_fp16":
            # the lists hold float16 vectors: half of ivf_flat's memory, fewer bytes streamed per probed list
            # (bench_index_1m.txt, tuned to recall 0.95, 1 thread: 0.956 at 2.75 ms against ivf_flat 0.957 at 3.06)
            base = faiss.IndexIVFScalarQuantizer(quantizer, dim, nlist, faiss.ScalarQuantizer.QT_fp16,
                                                 faiss.METRIC_INNER_PRODUCT)
        else:
            # not IndexIVFPQFastScan: its 8-bit lookup tables blur the close inner products of text queries
            # against image vectors (bench_index mix, 100K, M=128 4-bit: recall@10 0.44 -> 0.23, before refine)
            base = faiss.IndexIVFPQ(quantizer, dim, nlist, pq_m, spec.pq_nbits, faiss.METRIC_INNER_PRODUCT)
        base.nprobe = spec.nprobe
        return base
    else:
        raise ValueError(f"unresolved index type {spec.type!r}")
    return faiss.IndexIDMap2(base)


ADD_CHUNK_ROWS = 65_536


def add_chunk_rows(spec: IndexSpec, chunk: int = ADD_CHUNK_ROWS) -> int:
    """Rows per ``add_with_ids`` call: ``chunk``, fewer for ``ivf_pq``, whose encoding of a batch goes
    through n x M x 2^nbits distance tables (kept near 64 MB)."""
    if spec.type == "ivf_pq":
        return max(256, min(chunk, (64 << 20) // ((spec.pq_m or 1) * (1 << spec.pq_nbits) * 4)))
    return chunk


def add_in_chunks(index: faiss.Index, vectors: np.ndarray, ids: np.ndarray, chunk: int = ADD_CHUNK_ROWS,
                  on_added: Callable[[int], None] | None = None) -> None:
    """Add the rows chunk by chunk (a memory-mapped collection is read a chunk at a time), calling
    ``on_added(rows added so far)`` after each: where a build reports progress, and where a cancelled
    one stops (the callback raises)."""
    for begin in range(0, len(ids), chunk):
        index.add_with_ids(np.ascontiguousarray(vectors[begin:begin + chunk], dtype=np.float32),
                           np.ascontiguousarray(ids[begin:begin + chunk], dtype=np.int64))
        if on_added is not None:
            on_added(min(begin + chunk, len(ids)))


def train_and_add(index: faiss.Index, vectors: np.ndarray, ids: np.ndarray, chunk: int = ADD_CHUNK_ROWS,
                  on_added: Callable[[int], None] | None = None) -> faiss.Index:
    if not index.is_trained:
        index.train(np.ascontiguousarray(vectors, dtype=np.float32))
    add_in_chunks(index, vectors, ids, chunk, on_added)
    return index


def apply_search_params(index: faiss.Index, spec: IndexSpec) -> None:
    base = faiss.downcast_index(index.index) if isinstance(index, faiss.IndexIDMap) else index
    if hasattr(base, "hnsw"):
        base.hnsw.efSearch = spec.ef_search
    if hasattr(base, "nprobe"):
        base.nprobe = spec.nprobe


def gpu_count() -> int:
    get = getattr(faiss, "get_num_gpus", None)
    return int(get()) if get else 0


# One exact search on the GPUs, run in a child process by ``gpu_search_works``.
GPU_PROBE = """
import faiss, numpy as np
queries = np.eye(8, dtype="float32")
index = faiss.index_cpu_to_all_gpus(faiss.IndexFlatIP(8))
index.add(queries)
_, found = index.search(queries[:3], 1)
assert found[:, 0].tolist() == [0, 1, 2], found
"""


@functools.cache
def gpu_search_works(timeout_s: float = 300.0) -> bool:
    """Whether a search on the GPUs FAISS sees runs, tried once per process in a child process.

    faiss checks its CUDA calls with assertions that abort() the process, so a GPU its build has no
    kernels for would kill the server at its first search, not raise. The PyPI faiss-gpu-cu12 wheel
    carries machine code for compute capability 7.0 and 8.x only (sm_70, sm_80, no PTX to compile for
    another): on an H100/H200 (9.0) or a Blackwell GPU its kernels cannot launch."""
    try:
        done = subprocess.run([sys.executable, "-c", GPU_PROBE], capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        log.warning("FAISS GPU search: the test search did not finish in %.0f s; searching on CPU", timeout_s)
        return False
    if done.returncode != 0:
        detail = (done.stderr.strip().splitlines() or ["no message"])[-1]
        log.warning("FAISS sees %d GPUs, but a search on them failed in a test process (exit %d: %s); searching on "
                    "CPU. faiss-gpu wheels from PyPI run on compute capability 7.0-8.9 only: for another GPU, "
                    "build faiss with its architecture", gpu_count(), done.returncode, detail)
        return False
    return True


def to_search_device(index: faiss.Index, spec: IndexSpec, use_gpu: bool | None = None) -> tuple[faiss.Index, str]:
    """Move flat/IVF indexes to the GPUs FAISS sees (HNSW has no GPU version), where a test search
    on them works (``gpu_search_works``); else stay on CPU."""
    want = gpu_count() > 0 if use_gpu is None else use_gpu
    if want and spec.type != "hnsw" and gpu_count() > 0 and gpu_search_works():
        try:
            return faiss.index_cpu_to_all_gpus(index), "gpu"
        except Exception as exc:  # a GPU build without usable devices: keep serving on CPU
            log.warning("FAISS GPU placement failed, searching on CPU: %s", exc)
    return index, "cpu"


def set_threads(threads: int | None) -> None:
    """FAISS' OpenMP threads for searches started by the calling thread (OpenMP keeps this per thread:
    call it on the thread that searches). An exact search of a few queries on a large flat index
    splits the collection among this many threads (``split_scan``)."""
    if threads:
        faiss.omp_set_num_threads(int(threads))


def search_threads() -> int:
    """The calling thread's FAISS thread count (``set_threads``)."""
    return int(faiss.omp_get_max_threads())


@contextmanager
def one_thread():
    """FAISS on one OpenMP thread for the calling thread meanwhile. faiss shares a search out by query,
    so a single query gains nothing from a team of threads, whose idle members then spin for a while
    on the cores the next encoder call needs (the embedded default: ~5 ms of CPU per request)."""
    own = search_threads()
    faiss.omp_set_num_threads(1)
    try:
        yield
    finally:
        faiss.omp_set_num_threads(own)


# faiss' exhaustive search shares work out by query, so one query scans the whole collection on one
# thread while the other cores idle. Split below this many rows, the fork/join costs more than it saves.
SPLIT_SCAN_MIN_ROWS = 32_768
_helpers: ThreadPoolExecutor | None = None
_helpers_lock = threading.Lock()


def scan_helpers() -> ThreadPoolExecutor:
    """The threads that scan the other parts of a collection split among cores (one fewer than the
    cores: the calling thread scans the first part)."""
    global _helpers
    with _helpers_lock:
        if _helpers is None:
            # each helper scans its part on one OpenMP thread: a second one would only spin
            _helpers = ThreadPoolExecutor(max(1, (os.cpu_count() or 2) - 1), thread_name_prefix="faiss-scan",
                                          initializer=faiss.omp_set_num_threads, initargs=(1,))
        return _helpers


def flat_rows(index: faiss.Index) -> np.ndarray | None:
    """The vectors of a CPU inner-product flat index (bare or inside an IndexIDMap) as a read-only
    numpy view of the index's own memory, row i = the i-th vector added; None for other indexes."""
    base = faiss.downcast_index(index.index) if isinstance(index, (faiss.IndexIDMap, faiss.IndexIDMap2)) else index
    if not isinstance(base, faiss.IndexFlatIP) or base.ntotal == 0:
        return None
    rows = faiss.rev_swig_ptr(base.get_xb(), base.ntotal * base.d).reshape(base.ntotal, base.d)
    rows.flags.writeable = False
    return rows


def _scan_part(rows: np.ndarray, begin: int, end: int, queries: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    scores, found = faiss.knn(queries, rows[begin:end], min(k, end - begin), metric=faiss.METRIC_INNER_PRODUCT)
    return scores, found + begin


def split_scan(rows: np.ndarray, queries: np.ndarray, k: int, parts: int) -> tuple[np.ndarray, np.ndarray]:
    """Exact inner-product top k of ``queries`` among ``rows`` (scores, row numbers), the rows split
    into ``parts`` scanned side by side: the calling thread scans the first, helper threads the others.
    For a single query on 2 cores, 100K x 512: 19.7 -> 11.1 ms (faiss' own search against this)."""
    queries = np.ascontiguousarray(queries, dtype=np.float32)
    bounds = np.linspace(0, len(rows), max(1, parts) + 1).astype(int)
    use_blas_for(len(queries))
    pending = [scan_helpers().submit(_scan_part, rows, int(b), int(e), queries, k)
               for b, e in zip(bounds[1:-1], bounds[2:])]
    with one_thread():
        found = [_scan_part(rows, 0, int(bounds[1]), queries, k)]
    found += [p.result() for p in pending]
    scores = np.concatenate([f[0] for f in found], axis=1)
    numbers = np.concatenate([f[1] for f in found], axis=1)
    top = np.argsort(-scores, axis=1, kind="stable")[:, :min(k, len(rows))]
    return np.take_along_axis(scores, top, axis=1), np.take_along_axis(numbers, top, axis=1)


def exact_search(vectors: np.ndarray, ids: np.ndarray, queries: np.ndarray, k: int, chunk: int = 16_384) -> np.ndarray:
    """Ground-truth top-k ids by brute force (used to measure approximate indexes' recall), chunk by
    chunk over ``vectors`` so that a memory-mapped collection is never held in memory whole."""
    q = np.ascontiguousarray(queries, dtype=np.float32)
    k = min(k, len(ids))
    heap = faiss.ResultHeap(len(q), k)  # running top-k over the chunks (negated: the heap keeps the smallest)
    for begin in range(0, len(vectors), chunk):
        flat = faiss.IndexFlatIP(q.shape[1])
        flat.add(np.ascontiguousarray(vectors[begin:begin + chunk], dtype=np.float32))
        scores, rows = flat.search(q, min(k, flat.ntotal))
        heap.add_result(-scores, rows + begin)
    heap.finalize()
    return ids[heap.I]


def _consecutive(ids: np.ndarray, chunk: int = 1 << 20) -> bool:
    """Whether ``ids`` are first, first + 1, ... (checked a chunk at a time: no array of N temporaries)."""
    if len(ids) == 0 or int(ids[-1]) - int(ids[0]) != len(ids) - 1:
        return False
    first = int(ids[0])
    return all(np.array_equal(ids[b:b + chunk], np.arange(first + b, first + min(b + chunk, len(ids))))
               for b in range(0, len(ids), chunk))


class IdRows:
    """Image id -> row number in a snapshot's id order (``ids.npy``, which is also the order of
    ``vectors.npy`` and ``metadata.jsonl``). Consecutive ids (a generated collection, or row numbers)
    are mapped by arithmetic; others through a sorted copy and its order (16 bytes a vector)."""

    def __init__(self, ids: np.ndarray):
        ids = np.asarray(ids, np.int64)
        self.count = len(ids)
        self._first: int | None = int(ids[0]) if _consecutive(ids) else None
        if self._first is None:
            self._order = np.argsort(ids, kind="stable")
            self._sorted = ids[self._order]

    def lookup(self, image_ids) -> tuple[np.ndarray, np.ndarray]:
        """(rows, found): the row of each id; for an id not present, found is False and its row 0."""
        image_ids = np.asarray(image_ids, np.int64)
        if self.count == 0:
            return np.zeros(image_ids.shape, np.int64), np.zeros(image_ids.shape, bool)
        if self._first is not None:
            rows = image_ids - self._first
            found = (rows >= 0) & (rows < self.count)
            return np.where(found, rows, 0), found
        pos = np.minimum(np.searchsorted(self._sorted, image_ids), self.count - 1)
        found = self._sorted[pos] == image_ids
        return np.where(found, self._order[pos], 0), found

    def rows(self, image_ids) -> np.ndarray:
        """The rows of ids that must all be present (KeyError naming the first missing ones)."""
        image_ids = np.asarray(image_ids, np.int64)
        rows, found = self.lookup(image_ids)
        if not found.all():
            raise KeyError(f"ids not in the index: {image_ids[~found][:5].tolist()}")
        return rows


class ExactVectors:
    """The exact vectors behind an index, looked up by id: the refine stage's re-ranking reads them
    (a memory map of the snapshot's ``vectors.npy``: only the candidates' rows are touched)."""

    def __init__(self, vectors: np.ndarray, ids: np.ndarray | IdRows):
        self.vectors = vectors
        self.id_rows = ids if isinstance(ids, IdRows) else IdRows(ids)

    def rows(self, image_ids: np.ndarray) -> np.ndarray:
        return self.id_rows.rows(image_ids)

    def rerank(self, queries: np.ndarray, candidates: np.ndarray, k: int,
               block_bytes: int = 32 << 20) -> tuple[np.ndarray, np.ndarray]:
        """(scores, ids) of the k best candidates of each query by exact inner product; -1 pads. Queries
        go in blocks whose gathered candidate vectors stay under ``block_bytes``."""
        step = max(1, block_bytes // max(1, candidates.shape[1] * self.vectors.shape[1] * 4))
        if len(candidates) > step:
            parts = [self.rerank(queries[i:i + step], candidates[i:i + step], k, block_bytes)
                     for i in range(0, len(candidates), step)]
            return np.vstack([p[0] for p in parts]), np.vstack([p[1] for p in parts])
        q, width = candidates.shape
        valid = candidates >= 0
        rows, found = self.id_rows.lookup(candidates)
        if (valid & ~found).any():
            raise KeyError(f"ids not in the index: {candidates[valid & ~found][:5].tolist()}")
        flat_rows = rows.ravel()
        order = np.argsort(flat_rows, kind="stable")  # read the memory map front to back
        gathered = np.empty((len(flat_rows), self.vectors.shape[1]), np.float32)
        gathered[order] = self.vectors[flat_rows[order]]
        scores = np.einsum("qkd,qd->qk", gathered.reshape(q, width, -1), queries.astype(np.float32, copy=False))
        scores[~valid] = -np.inf
        k = min(k, width)
        top = np.argsort(-scores, axis=1, kind="stable")[:, :k]
        ids = np.take_along_axis(candidates, top, axis=1)
        best = np.take_along_axis(scores, top, axis=1)
        ids[~np.isfinite(best)] = -1
        return best.astype(np.float32), ids


# faiss computes exhaustive distances either vector by vector (SIMD) or as one matrix product
# (BLAS), switching at a process-wide threshold. The installed faiss' default keeps merged batches on
# the SIMD path: at 100K x 384 on 2 cores a batch of 64 then runs at ~200 queries/s, against ~1,800
# with BLAS; a single query is fastest on SIMD (11 ms against 30). So: BLAS from this many queries on.
BLAS_MIN_QUERIES = 4
_BLAS_ON, _BLAS_OFF = 1, 2**31 - 1  # an int in C
# The BLAS path multiplies blocks of (query rows) x (collection rows), buffering one score block.
# faiss' default 4,096 x 1,024 suits large query sets; a merged serving batch (4-256 rows) on 2 threads
# then pays a fork/join per 1,024 collection rows: 256 x 16,384 (the same 16 MB buffer) ran batches of
# 8-64 queries 1.3-1.5x faster at 100K x 384 (32 queries: 37 -> 25 ms); 1,024 queries were 13% slower,
# so larger query sets keep the default.
_SERVING_BLOCKS, _DEFAULT_BLOCKS = (256, 16_384), (4_096, 1_024)


def use_blas_for(n_queries: int) -> None:
    """Set faiss' exhaustive-search path and block sizes for a search of ``n_queries`` (process-wide)."""
    faiss.cvar.distance_compute_blas_threshold = _BLAS_ON if n_queries >= BLAS_MIN_QUERIES else _BLAS_OFF
    query_rows, collection_rows = _SERVING_BLOCKS if n_queries <= _SERVING_BLOCKS[0] else _DEFAULT_BLOCKS
    faiss.cvar.distance_compute_blas_query_bs = query_rows
    faiss.cvar.distance_compute_blas_database_bs = collection_rows


def id_selector(ids: np.ndarray) -> faiss.IDSelector:
    """A selector accepting exactly ``ids`` (int64, not empty). A bitmap of one bit per possible id where
    the ids are non-negative and their largest is below 64x their count (at most 8 bytes an accepted
    id; at 10M x 384, half the collection: 1.25 MB built in milliseconds), else faiss' hash set with
    its Bloom filter (~40 bytes an id: ~200 MB and seconds for 5M)."""
    ids = np.asarray(ids, np.int64)
    if len(ids) and int(ids.min()) >= 0 and int(ids.max()) < 64 * len(ids):
        bits = np.zeros(int(ids.max()) + 1, bool)
        bits[ids] = True
        # faiss' Python wrapper takes the array and keeps it alive; its stubs show the C++ (n, pointer) form
        return faiss.IDSelectorBitmap(np.packbits(bits, bitorder="little"))  # type: ignore[call-arg, arg-type]
    return faiss.IDSelectorBatch(ids)


def search_parameters(spec: IndexSpec, selector) -> faiss.SearchParameters:
    """Per-call search parameters restricting a search to the ids ``selector`` accepts (IndexIDMap
    translates it to its rows), with the spec's nprobe / efSearch."""
    params: faiss.SearchParameters
    if spec.type == "hnsw":
        params = faiss.SearchParametersHNSW()  # type: ignore[attr-defined]  # missing from faiss' stubs
        params.efSearch = spec.ef_search  # type: ignore[attr-defined]
    elif spec.type in IVF_TYPES:
        params = faiss.SearchParametersIVF()
        params.nprobe = spec.nprobe
    else:
        params = faiss.SearchParameters()
    params.sel = selector
    return params


def search(index: faiss.Index, spec: IndexSpec, queries: np.ndarray, k: int,
           exact: ExactVectors | None = None, params: faiss.SearchParameters | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(scores, ids) of the top k, through the refine stage when the spec asks for it; ``params``
    (``search_parameters``) restricts the search to a set of ids."""
    queries = np.ascontiguousarray(queries, dtype=np.float32)
    use_blas_for(len(queries))
    with one_thread() if len(queries) == 1 else nullcontext():
        if (spec.refine_factor or 1) <= 1 or exact is None or spec.exact:
            return index.search(queries, k, params=params)
        _, candidates = index.search(queries, min(k * (spec.refine_factor or 1), index.ntotal), params=params)
    return exact.rerank(queries, candidates, k)


def masked_exact_search(vectors: np.ndarray, ids: np.ndarray, rows: np.ndarray, queries: np.ndarray, k: int,
                        chunk: int = 16_384) -> tuple[np.ndarray, np.ndarray]:
    """Exact (scores, ids) top k among the rows ``rows`` (sorted row numbers) of ``vectors``; -1 pads.
    A few matching rows are gathered and scanned; many are scanned in place, chunk by chunk, with the
    others scored -inf (one matrix product per chunk either way, so the cost never exceeds a full scan)."""
    q = np.ascontiguousarray(np.atleast_2d(queries), dtype=np.float32)
    kk = min(k, len(rows))
    scores_out = np.full((len(q), k), -np.inf, np.float32)
    ids_out = np.full((len(q), k), -1, np.int64)
    if kk == 0:
        return scores_out, ids_out
    heap = faiss.ResultHeap(len(q), kk)  # keeps the smallest: scores go in negated
    if len(rows) * 4 <= len(ids):
        for begin in range(0, len(rows), chunk):
            part = rows[begin:begin + chunk]
            block = np.asarray(vectors[part], np.float32) @ q.T
            heap.add_result(np.ascontiguousarray(-block.T), np.ascontiguousarray(np.broadcast_to(part, (len(q), len(part)))))
    else:
        keep = np.zeros(len(ids), bool)
        keep[rows] = True
        for begin in range(0, len(ids), chunk):
            block = np.asarray(vectors[begin:begin + chunk], np.float32) @ q.T
            block[~keep[begin:begin + chunk]] = -np.inf
            heap.add_result(np.ascontiguousarray(-block.T), np.ascontiguousarray(
                np.broadcast_to(np.arange(begin, begin + len(block)), (len(q), len(block)))))
    heap.finalize()
    found = heap.I >= 0
    scores_out[:, :kk] = np.where(found, -heap.D, -np.inf)
    ids_out[:, :kk] = np.where(found, ids[np.maximum(heap.I, 0)], -1)
    return scores_out, ids_out


# search-time settings tried by tune_for_recall, cheapest first within each family
_NPROBES = [1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024, 1536, 2048, 4096]
_EF_SEARCH = [16, 32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024, 2048]
_REFINE = [20, 50, 100, 10, 5, 2, 1]  # the default first: a good setting early prunes the other families


def _candidates(spec: IndexSpec) -> list[list[IndexSpec]]:
    """Families of settings, each ordered by growing cost (recall grows along a family)."""
    if spec.type == "hnsw":
        return [[spec.model_copy(update={"ef_search": ef}) for ef in _EF_SEARCH]]
    nlist = spec.nlist or 1
    probes = [p for p in _NPROBES if p < nlist] + [nlist]
    if spec.type in ("ivf_flat", "ivf_fp16"):
        return [[spec.model_copy(update={"nprobe": p}) for p in probes]]
    if spec.type == "ivf_pq":
        return [[spec.model_copy(update={"nprobe": p, "refine_factor": r}) for p in probes] for r in _REFINE]
    return []


def tune_setting(run, spec: IndexSpec, queries: np.ndarray, truth: np.ndarray, target: float,
                 k: int = 10, margin_se: float = 0.0) -> tuple[IndexSpec, float, float]:
    """The fastest search setting (nprobe, efSearch, refine factor) whose recall@k on ``queries``
    (against ``truth``, exact top-k ids) reaches ``target``; else the most accurate one tried.
    ``margin_se``: the recall must reach it less this many standard errors of the mean of the
    queries' recalls (2: a setting that queries like these reach with ~97 % confidence, not one that
    just reaches it on these and falls short on others half the time).
    ``run(candidate_spec, queries, k)`` searches with a setting and returns the ids (any backend).
    -> (spec, its recall on these queries, milliseconds per query)."""
    import time

    best: tuple[IndexSpec, float, float] | None = None
    fallback: tuple[IndexSpec, float, float] | None = None
    for family in _candidates(spec):
        recent: list[float] = []
        for candidate in family:
            start = time.perf_counter()
            got = run(candidate, queries, k)
            ms = (time.perf_counter() - start) * 1000 / len(queries)
            recalls = overlap_recalls(got, truth)
            recall = float(recalls.mean())
            if fallback is None or recall > fallback[1]:
                fallback = (candidate, recall, ms)
            if recall - margin_se * float(recalls.std(ddof=1)) / math.sqrt(len(recalls)) >= target:
                if best is None or ms < best[2]:
                    best = (candidate, recall, ms)
                break  # the rest of this family only costs more
            if best is not None and ms >= best[2]:
                break  # already slower than a setting that reaches the target
            recent.append(recall)
            if len(recent) >= 4 and recent[-1] - recent[-4] < 0.002:
                break  # saturated: PQ codes without enough refine stop improving with more probes
    chosen = best or fallback
    if chosen is None:  # flat: nothing to tune
        return spec, 1.0, 0.0
    return chosen


def tune_for_recall(index: faiss.Index, spec: IndexSpec, exact: ExactVectors, queries: np.ndarray,
                    truth: np.ndarray, target: float, k: int = 10) -> tuple[IndexSpec, float, float]:
    """``tune_setting`` on a FAISS index; the index is left set to the chosen setting."""
    def run(candidate: IndexSpec, q: np.ndarray, kk: int) -> np.ndarray:
        apply_search_params(index, candidate)
        return search(index, candidate, q, kk, exact)[1]

    chosen = tune_setting(run, spec, queries, truth, target, k)
    apply_search_params(index, chosen[0])
    return chosen
