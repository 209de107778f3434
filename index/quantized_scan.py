"""Searches of a few queries over a flat collection on the CPU, from a quantized copy of its rows.

One query against a flat collection does 2 flops a byte it reads: the scan is bound by memory
bandwidth, not arithmetic, and gets slower the longer the rows have been out of the cache (100K x 384,
2-core Emerald Rapids, two threads: 3.5-3.8 ms back to back, 5-6 ms in a server at concurrency 1, where
a request's encoder call and the network pass between two searches). A copy of the rows in fewer bytes,
scored by faiss' scalar quantizer (decoded in registers), reads less:

* ``int8`` (the default): one byte a dimension, each dimension's range of the rows in 256 steps. The
  same collection, two threads, right after an encoder call: 3.3-3.8 ms from an fp16 copy, 2.7-2.8
  from this one (and the same 2.6 in a tight loop, where both stay in the cache).
* ``fp16``: two bytes a dimension, about 1/2048 of each value.

Each part's best candidates are rescored from the fp32 rows, and a query whose k-th score is not
clear of what a part left out, by the most the copy can misjudge a score, is scanned again for more:
the results are the flat index's. That most is measured, not assumed: the largest difference between
each dimension's stored values and their decoded copies, over every row, weighted by the query's
absolute values (|q.x - q.x'| <= sum_i |q_i| |x_i - x'_i|), plus a margin for the kernel's own float
sums. On 600 encoded COCO captions over 100K x 384 rows, none needed a second scan at k 10 to 128
with ``2k + 64`` candidates a part (int8 or fp16).

Batches of many queries stay with faiss' fp32 BLAS path, which is bound by arithmetic and reads the rows
once for the whole batch.
"""

from __future__ import annotations

import math
import os
from typing import Literal

import faiss
import numpy as np

from paraseek.index.faiss_index import one_thread, scan_helpers

Codec = Literal["int8", "fp16"]
CODECS: dict[str, int] = {"int8": faiss.ScalarQuantizer.QT_8bit, "fp16": faiss.ScalarQuantizer.QT_fp16}
BYTES_PER_DIMENSION: dict[str, int] = {"int8": 1, "fp16": 2}  # what a copy of N x d rows holds: N d times this
# candidates a part gives for rescoring: 2k + EXTRA_CANDIDATES
EXTRA_CANDIDATES = 64
# past this k the candidates' heaps and rescoring cost more than the smaller reads save (100K x 384, 2 cores,
# one query after an encoder call, int8 copy against the fp32 split scan: k 100 2.7 against ~5.5 ms; fp16's
# copy with 4k candidates broke even at 64)
MAX_K = 128
FP16_MAX = float(np.finfo(np.float16).max)
_BLOCK = 8_192  # rows decoded at a time when measuring the copy's error: temporaries of a few MB, which the heap reuses


def _available_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


class QuantizedScan:
    """A copy of ``rows`` (N, d) float32, the rows of an inner-product flat index, in ``codec``, in
    ``chunks`` consecutive parts (default: one a core), so a search can share them among threads."""

    def __init__(self, rows: np.ndarray, codec: Codec = "int8", chunks: int | None = None):
        if codec not in CODECS:
            raise ValueError(f"codec {codec!r}: one of {', '.join(CODECS)}")
        self.rows = rows
        self.codec = codec
        count, dim = rows.shape
        chunks = max(1, min(chunks or _available_cores(), count))
        bounds = np.linspace(0, count, chunks + 1).astype(np.int64)
        self._parts: list[tuple[int, faiss.Index]] = []
        error = np.zeros(dim, np.float32)  # the most a dimension's decoded value differs from the stored one
        largest = 0.0  # the largest squared row norm
        for begin, end in zip(bounds[:-1], bounds[1:]):
            part_rows = np.ascontiguousarray(rows[begin:end], dtype=np.float32)
            if codec == "fp16" and any(float(np.abs(part_rows[b:b + _BLOCK]).max()) > FP16_MAX
                                       for b in range(0, len(part_rows), _BLOCK)):
                raise ValueError("the vectors have components beyond fp16's range")
            part = faiss.IndexScalarQuantizer(dim, CODECS[codec], faiss.METRIC_INNER_PRODUCT)
            part.train(part_rows)  # int8: each dimension's range over this part's rows (fp16 trains nothing)
            part.add(part_rows)
            for b in range(0, len(part_rows), _BLOCK):
                block = part_rows[b:b + _BLOCK]
                decoded = part.sa_decode(part.sa_encode(block))
                error = np.maximum(error, np.abs(decoded - block).max(axis=0))
                largest = max(largest, float(np.einsum("ij,ij->i", block, block).max()))
            self._parts.append((int(begin), part))
        self._error = error
        # the kernel's float32 sums (and its decoding, which may round differently from sa_decode): at most
        # d * 2^-24 of sum |q_i x_i| <= |q| |x|; four times that
        self._rounding_per_query_norm = dim * 2.0 ** -22 * math.sqrt(largest)

    @property
    def nbytes(self) -> int:
        """Memory the copy holds."""
        return sum(part.sa_code_size() * part.ntotal for _, part in self._parts)

    def score_error(self, queries: np.ndarray) -> np.ndarray:
        """Per query, the most a row's score from the copy can differ from its fp32 score."""
        return np.abs(queries) @ self._error + self._rounding_per_query_norm * np.linalg.norm(queries, axis=1)

    def search(self, queries: np.ndarray, k: int, threads: int = 1,
               among: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
        """(scores, row numbers), each (Q, min(k, rows searched)), best first, ties in row order; the
        parts shared among ``threads`` (the calling one and the scan helpers), each on one OpenMP thread.
        ``among``: only these row numbers (a filter's matches; meant for broad ones: the scan reads every
        row and keeps the candidates among them, taking more in proportion).

        A query whose k-th score is not clear of what its parts left out (the copy cannot tell their
        best left-out rows from it: near-duplicates) is scanned again for four times the candidates."""
        queries = np.ascontiguousarray(np.atleast_2d(queries), dtype=np.float32)
        count = len(self.rows)
        accepted = None
        if among is not None:
            accepted = np.zeros(count, bool)
            accepted[among] = True
        k = min(int(k), count if among is None else len(among))
        scores = np.empty((len(queries), k), np.float32)
        numbers = np.empty((len(queries), k), np.int64)
        errors = self.score_error(queries)
        todo = np.arange(len(queries)) if k else np.arange(0)
        wanted = 2 * k + EXTRA_CANDIDATES
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
    """Each part's top ``wanted`` rows by their copy's scores (Q, ...), -1 padded, and per query the best
    copy's score a part left out could have (-inf where every part gave all its rows)."""
    threads = max(1, min(threads, len(parts)))
    groups = [parts[i::threads] for i in range(threads)]
    pending = [scan_helpers().submit(_scan_parts, group, queries, wanted) for group in groups[1:]]
    with one_thread():
        found = [_scan_parts(groups[0], queries, wanted)]
    found += [p.result() for p in pending]
    return (np.concatenate([rows for rows, _ in found], axis=1),
            np.max(np.stack([left_out for _, left_out in found]), axis=0))


def _scan_parts(parts: list[tuple[int, faiss.Index]], queries: np.ndarray, wanted: int) -> tuple[np.ndarray, np.ndarray]:
    """(candidate row numbers (Q, the parts' top ``wanted`` each), -1 padded; the best copy's score these
    parts left out could have, per query: the last one kept by a part that had more rows)."""
    found = []
    left_out = np.full(len(queries), -np.inf, np.float32)
    for begin, part in parts:
        scores, rows = part.search(queries, min(wanted, part.ntotal))
        found.append(np.where(rows >= 0, rows + begin, -1))
        if part.ntotal > wanted:
            left_out = np.maximum(left_out, scores[:, -1])
    return np.concatenate(found, axis=1), left_out
