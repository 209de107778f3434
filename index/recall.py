"""Recall of an approximate index against exact search, and tuning its search setting to a target:
any backend (``measure_recall_with``), or a FAISS index (``measure_recall``). The builder and both
stores measure every published version with these."""

from __future__ import annotations

from typing import Callable

import faiss
import numpy as np

from paraseek.core.rank_metrics import overlap_recall
from paraseek.index.faiss_index import (
    ExactVectors,
    IndexSpec,
    add_chunk_rows,
    apply_search_params,
    create_index,
    exact_search,
    search,
    train_and_add,
    tune_setting,
)
from paraseek.index.versions import BuildError

RECALL_QUERIES = 1000
# the tuned setting's recall on the tuning queries, less this many standard errors, must reach the target
TUNING_MARGIN_SE = 2.0


def split_recall_queries(count: int) -> tuple[np.ndarray, np.ndarray]:
    """(tuning rows, held-out rows) of ``count`` recall queries: halves drawn at random (seeded), since
    queries given in some order (by topic, by source) would tune on one kind and check on another
    (10M, 500 caption-like queries: the given order's second half had 0.015 lower recall than its first)."""
    order = np.random.default_rng(0).permutation(count)
    return order[:count // 2], order[count // 2:]


def build_faiss_index(spec: IndexSpec, vectors: np.ndarray, ids: np.ndarray,
                      on_added: Callable[[int], None] | None = None) -> tuple[IndexSpec, faiss.Index]:
    """The index ``spec`` resolves to, trained and filled; ``on_added(rows)`` after each chunk added."""
    spec = spec.resolved(len(ids), vectors.shape[1])
    return spec, train_and_add(create_index(spec, vectors.shape[1]), vectors, ids, add_chunk_rows(spec), on_added)


def measure_recall(index, spec: IndexSpec, vectors, ids, queries, k: int = 10, target_recall: float | None = None,
                   query_source: str = "") -> tuple[IndexSpec, float | None, int, dict | None]:
    """``measure_recall_with`` a FAISS index (through its refine stage); the index is left set to the
    chosen search setting."""
    exact = ExactVectors(vectors, ids)

    def run(candidate: IndexSpec, q: np.ndarray, kk: int) -> np.ndarray:
        apply_search_params(index, candidate)
        return search(index, candidate, q, kk, exact)[1]

    return measure_recall_with(run, spec, vectors, ids, queries, k, target_recall, query_source)


def measure_recall_with(run, spec: IndexSpec, vectors, ids, queries, k: int = 10, target_recall: float | None = None,
                        query_source: str = "", exact: bool | None = None) -> tuple[IndexSpec, float | None, int, dict | None]:
    """Recall@k of an approximate index against exact search -> (spec, recall, queries, tuning), any
    backend: ``run(spec, queries, k)`` searches with a setting and returns the ids.

    With ``target_recall`` the queries are split (``split_recall_queries``): one half tunes the search
    setting (``tune_setting``: nprobe, efSearch, refine factor; its recall less two standard errors must
    reach the target), the held-out half measures the recall recorded in the manifest, so the number is
    not the one the tuning optimised. ``exact`` overrides
    whether the index is exact (default: the spec says)."""
    if (spec.exact if exact is None else exact) or len(ids) == 0:
        return spec, None, 0, None
    queries = np.ascontiguousarray(queries[:RECALL_QUERIES], np.float32)
    truth = exact_search(vectors, ids, queries, k)
    tuning = None
    if target_recall is not None:
        if len(queries) < 4:
            raise BuildError(f"--target-recall needs at least 4 queries to tune and check on, there are {len(queries)}")
        tune_rows, held_rows = split_recall_queries(len(queries))
        spec, tuned_recall, ms = tune_setting(run, spec, queries[tune_rows], truth[tune_rows], target_recall, k,
                                              margin_se=TUNING_MARGIN_SE)
        tuning = {"target_recall": target_recall, "margin_standard_errors": TUNING_MARGIN_SE,
                  "reached": tuned_recall >= target_recall,
                  "recall_at_10_on_tuning_queries": round(tuned_recall, 4), "tuning_queries": len(tune_rows),
                  "ms_per_query_at_tuning": round(ms, 4), "queries": query_source,
                  "setting": {"nprobe": spec.nprobe, "ef_search": spec.ef_search, "refine_factor": spec.refine_factor}}
        queries, truth = queries[held_rows], truth[held_rows]
    got = run(spec, queries, truth.shape[1])
    return spec, overlap_recall(got, truth), len(queries), tuning
