"""FAISS index types, their parameters, and CPU/GPU placement chosen at run time."""

from __future__ import annotations

import logging
import math
from typing import Literal

import faiss
import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from core.errors import UserError

log = logging.getLogger(__name__)

# Exact search is the default up to this many vectors; beyond it `auto` picks HNSW.
EXACT_LIMIT = 200_000


class IndexSpec(BaseModel):
    """Which FAISS index to build. Inner product on L2-normalised vectors = cosine similarity."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["auto", "flat", "hnsw", "ivf_flat", "ivf_pq"] = "auto"
    hnsw_m: int = Field(32, ge=4, le=128)
    ef_construction: int = Field(200, ge=8)
    ef_search: int = Field(128, ge=1)
    nlist: int | None = Field(None, ge=1, description="IVF lists; default ~4*sqrt(N)")
    nprobe: int = Field(16, ge=1)
    pq_m: int | None = Field(None, ge=1, description="PQ sub-quantisers; default dim/4 (must divide dim)")
    pq_nbits: int = Field(8, ge=4, le=12)

    def resolved(self, count: int, dim: int) -> IndexSpec:
        """Fill in defaults that depend on the data size."""
        upd: dict = {}
        kind = self.type
        if kind == "auto":
            kind = "flat" if count <= EXACT_LIMIT else "hnsw"
            upd["type"] = kind
        if kind in ("ivf_flat", "ivf_pq") and self.nlist is None:
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
        return self.model_copy(update=upd)

    @property
    def exact(self) -> bool:
        return self.type == "flat"


def create_index(spec: IndexSpec, dim: int) -> faiss.Index:
    """An empty index wrapped so that it stores our stable int64 ids."""
    base: faiss.Index
    nlist, pq_m = spec.nlist or 1, spec.pq_m or 1  # resolved() filled both for IVF types
    if spec.type == "flat":
        base = faiss.IndexFlatIP(dim)
    elif spec.type == "hnsw":
        base = faiss.IndexHNSWFlat(dim, spec.hnsw_m, faiss.METRIC_INNER_PRODUCT)
        base.hnsw.efConstruction = spec.ef_construction
        base.hnsw.efSearch = spec.ef_search
    elif spec.type == "ivf_flat":
        quantizer = faiss.IndexFlatIP(dim)
        base = faiss.IndexIVFFlat(quantizer, dim, nlist, faiss.METRIC_INNER_PRODUCT)
        base.nprobe = spec.nprobe
    elif spec.type == "ivf_pq":
        quantizer = faiss.IndexFlatIP(dim)
        base = faiss.IndexIVFPQ(quantizer, dim, nlist, pq_m, spec.pq_nbits, faiss.METRIC_INNER_PRODUCT)
        base.nprobe = spec.nprobe
    else:
        raise ValueError(f"unresolved index type {spec.type!r}")
    return faiss.IndexIDMap2(base)


def train_and_add(index: faiss.Index, vectors: np.ndarray, ids: np.ndarray) -> faiss.Index:
    vectors = np.ascontiguousarray(vectors, dtype=np.float32)
    if not index.is_trained:
        index.train(vectors)
    index.add_with_ids(vectors, np.ascontiguousarray(ids, dtype=np.int64))
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


def to_search_device(index: faiss.Index, spec: IndexSpec, use_gpu: bool | None = None) -> tuple[faiss.Index, str]:
    """Move flat/IVF indexes to the GPUs FAISS sees (HNSW has no GPU version); else stay on CPU."""
    want = gpu_count() > 0 if use_gpu is None else use_gpu
    if want and spec.type != "hnsw" and gpu_count() > 0:
        try:
            return faiss.index_cpu_to_all_gpus(index), "gpu"
        except Exception as exc:  # a GPU build without usable devices: keep serving on CPU
            log.warning("FAISS GPU placement failed, searching on CPU: %s", exc)
    return index, "cpu"


def set_threads(threads: int | None) -> None:
    """FAISS' OpenMP threads (process-wide). Batch-1 exact search is fastest on one thread here."""
    if threads:
        faiss.omp_set_num_threads(int(threads))


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
