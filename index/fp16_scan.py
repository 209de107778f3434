"""Searches of a few queries over a flat collection on the CPU, at half the memory traffic.

One query against a flat collection does 2 flops a byte it reads: the scan is bound by memory
bandwidth, not arithmetic, and gets slower the longer the rows have been out of the cache (100K x 384,
2-core Emerald Rapids, two threads: 3.5-3.8 ms back to back, 5-6 ms in a server at concurrency 1, where
a request's encoder call and the network pass between two searches). An fp16 copy of the rows, scored
by faiss' scalar quantizer (converted in registers, F16C / AVX-512), reads half the bytes: the same
collection on one thread 8.9 -> 3.9 ms. The few candidates each part finds are rescored from the fp32
rows, and a query whose k-th score is within fp16's rounding error of the best row a part left out is
scanned again for more: the results are the flat index's.

Batches of many queries stay with faiss' fp32 BLAS path, which is bound by arithmetic and reads the rows
once for the whole batch. The copy costs half the rows' memory again.
"""

from __future__ import annotations

import math
import os

import faiss
import numpy as np

from paraseek.index.faiss_index import one_thread, scan_helpers

# candidates per part, in multiples of k (and at least k + 16), rescored from the fp32 rows
RESCORE_FACTOR = 4
# past this k the candidates' heaps and rescoring cost more than the halved reads save (100K x 384, 2 cores,
# one query, fp16 against fp32 alternating: k 10 5.26 against 5.53 ms, 64 5.48 against 5.50, 100 5.77
# against 5.56); such searches take the fp32 path
MAX_K = 64
FP16_MAX = float(np.finfo(np.float16).max)


def _available_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


class Fp16Scan:
    """An fp16 copy of ``rows`` (N, d) float32, the rows of an inner-product flat index, in ``chunks``
    consecutive parts (default: one a core), so a search can share them among threads."""

    def __init__(self, rows: np.ndarray, chunks: int | None = None):
        self.rows = rows
        count = len(rows)
        chunks = max(1, min(chunks or _available_cores(), count))
        bounds = np.linspace(0, count, chunks + 1).astype(np.int64)
        self._parts: list[tuple[int, faiss.Index]] = []
        largest = 0.0
        for begin, end in zip(bounds[:-1], bounds[1:]):
            part_rows = np.ascontiguousarray(rows[begin:end], dtype=np.float32)
            for block in range(0, len(part_rows), 65_536):  # no temporary the size of the part
                block_rows = part_rows[block:block + 65_536]
                if float(np.abs(block_rows).max()) > FP16_MAX:
                    raise ValueError("the vectors have components beyond fp16's range")
                largest = max(largest, float(np.einsum("ij,ij->i", block_rows, block_rows).max()))
            part = faiss.IndexScalarQuantizer(rows.shape[1], faiss.ScalarQuantizer.QT_fp16, faiss.METRIC_INNER_PRODUCT)
            part.add(part_rows)  # fp16 needs no training
            self._parts.append((int(begin), part))
        # how far an fp16 score can be from the fp32 one, per unit of query norm: each component rounded
        # by at most 2^-11 of itself (2^-25 below fp16's normal range), doubled for the sums' own rounding
        self._error_per_query_norm = 2.0 ** -10 * math.sqrt(largest) + 2.0 ** -24 * math.sqrt(rows.shape[1])

    @property
    def nbytes(self) -> int:
        """Memory the copy holds."""
        return sum(part.sa_code_size() * part.ntotal for _, part in self._parts)

    def search(self, queries: np.ndarray, k: int, threads: int = 1,
               among: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
        """(scores, row numbers), each (Q, min(k, rows searched)), best first, ties in row order; the
        parts shared among ``threads`` (the calling one and the scan helpers), each on one OpenMP thread.
        ``among``: only these row numbers (a filter's matches; meant for broad ones: the scan reads every
        row and keeps the candidates among them, taking more in proportion).

        A query whose k-th score is not clear of what its parts left out (fp16 cannot tell their best
        left-out rows from it: near-duplicates) is scanned again for four times the candidates."""
        queries = np.ascontiguousarray(np.atleast_2d(queries), dtype=np.float32)
        count = len(self.rows)
        accepted = None
        if among is not None:
            accepted = np.zeros(count, bool)
            accepted[among] = True
        k = min(int(k), count if among is None else len(among))
        scores = np.empty((len(queries), k), np.float32)
        numbers = np.empty((len(queries), k), np.int64)
        errors = self._error_per_query_norm * np.linalg.norm(queries, axis=1)
        todo = np.arange(len(queries)) if k else np.arange(0)
        wanted = max(RESCORE_FACTOR * k, k + 16)
        if among is not None:  # the candidates kept are the filter's share of those found
            wanted = math.ceil(wanted * count / max(1, len(among)))
        while len(todo):
            candidates, left_out = _candidates(self._parts, queries[todo], wanted, threads)
            again = []
            for j, row in enumerate(todo):
                found = np.unique(candidates[j][candidates[j] >= 0])  # sorted: ties go to the lower row number
                if accepted is not None:
                    found = found[accepted[found]]
                exact = self.rows[found] @ queries[row]
                best = np.argsort(-exact, kind="stable")[:k]
                if len(best) < k or left_out[j] + errors[row] >= exact[best[-1]]:
                    again.append(row)
                    continue
                scores[row], numbers[row] = exact[best], found[best]
            todo, wanted = np.asarray(again, np.int64), wanted * 4
        return scores, numbers


def _candidates(parts: list[tuple[int, faiss.Index]], queries: np.ndarray, wanted: int,
                threads: int) -> tuple[np.ndarray, np.ndarray]:
    """Each part's top ``wanted`` rows by their fp16 scores (Q, ...), -1 padded, and per query the best
    fp16 score a part left out could have (-inf where every part gave all its rows)."""
    threads = max(1, min(threads, len(parts)))
    groups = [parts[i::threads] for i in range(threads)]
    pending = [scan_helpers().submit(_scan_parts, group, queries, wanted) for group in groups[1:]]
    with one_thread():
        found = [_scan_parts(groups[0], queries, wanted)]
    found += [p.result() for p in pending]
    return (np.concatenate([rows for rows, _ in found], axis=1),
            np.max(np.stack([left_out for _, left_out in found]), axis=0))


def _scan_parts(parts: list[tuple[int, faiss.Index]], queries: np.ndarray, wanted: int) -> tuple[np.ndarray, np.ndarray]:
    """(candidate row numbers (Q, the parts' top ``wanted`` each), -1 padded; the best fp16 score these
    parts left out could have, per query: the last one kept by a part that had more rows)."""
    found = []
    left_out = np.full(len(queries), -np.inf, np.float32)
    for begin, part in parts:
        scores, rows = part.search(queries, min(wanted, part.ntotal))
        found.append(np.where(rows >= 0, rows + begin, -1))
        if part.ntotal > wanted:
            left_out = np.maximum(left_out, scores[:, -1])
    return np.concatenate(found, axis=1), left_out
