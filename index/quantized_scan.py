"""Searches of a flat collection on the CPU from a quantized copy of its rows, exact all the same.

A flat index's exhaustive search reads every row for every batch of queries: one query does 2 flops a
byte, so the scan is bound by memory bandwidth, and a merged batch of 8-64 (faiss' fp32 matrix product)
still by bandwidth more than by arithmetic. A copy of the rows in fewer bytes reads less:

* ``int8`` (the default): one byte a dimension, each dimension's range of the rows in 256 steps,
  scored by onnxruntime's integer matrix product (VNNI/AMX kernels where the CPU has them) and its TopK.
  The query is split into two int8 parts, a coarse one and its remainder at ``1/factor`` of its step,
  scored together in one product, so what the query's rounding leaves out is ~1/256 of one int8 step:
  the copy's error is then almost all the rows' own rounding. 100K x 384 on 2 cores (Emerald Rapids,
  AVX-512 VNNI): one query 1.0 ms against 2.5 from faiss' scalar quantizer over the same bytes; 32
  queries 9.6 ms against 24 ms for faiss' fp32 product. onnxruntime keeps a packed copy of the codes
  beside them: two bytes a dimension in all.
* ``fp16``: two bytes a dimension, about 1/2048 of each value, scored by faiss' scalar quantizer in
  parts shared among threads; for searches of fewer than ``BLAS_MIN_QUERIES`` queries only (faiss
  scores them one query at a time).

The best candidates are rescored from the fp32 rows, and a query whose k-th score is not clear of what
the copy left out, by the most the copy can misjudge a score, is scanned again for more: the results
are the flat index's. That most is measured, not assumed: the largest difference between each
dimension's stored values and their decoded copies over every row, weighted by the query's absolute
values (|q.x - q.x'| <= sum_i |q_i| |x_i - x'_i|), plus the int8 query's own remainder times the largest
code of each dimension, plus a margin for float sums. On 600 encoded COCO captions over 100K x 384
rows, none needed a second scan at k 10 with ``2k + 64`` candidates.
"""

from __future__ import annotations

import functools
import math
import os
from pathlib import Path
from typing import Literal

import faiss
import numpy as np

from paraseek.index.faiss_index import BLAS_MIN_QUERIES, one_thread, scan_helpers

Codec = Literal["int8", "fp16"]
CODECS = ("int8", "fp16")
# what a copy of N x d rows holds: N d times this (int8: the codes and onnxruntime's packed copy of them)
BYTES_PER_DIMENSION: dict[str, int] = {"int8": 2, "fp16": 2}
# candidates given for rescoring: 2k + EXTRA_CANDIDATES
EXTRA_CANDIDATES = 64
# past this k the candidates' rescoring costs more than the smaller reads save (100K x 384, 2 cores: fp16's
# copy with 4k candidates broke even at 64; int8 at k 100 still 2x faster than the fp32 scan)
MAX_K = 128
FP16_MAX = float(np.finfo(np.float16).max)
_BLOCK = 8_192  # rows quantized at a time while building: temporaries of a few MB, which the heap reuses
_CODE_BLOCK = 2_048  # the same for int8's float64 arithmetic
# int8: the integer scores one onnxruntime call holds (2 x queries x rows int32) and its graph's
# intermediates a few times that, kept by its memory arena: 8 MB a call, 100K rows -> 10 queries a call;
# at least 4 queries a call all the same, since each call reads every code (1M rows: 16 ms a query alone)
_SCORES_BYTES = 1 << 23
_MIN_QUERIES_PER_CALL = 4
# past this many calls one fp32 matrix product over the batch reads less (1M x 384, 2 cores, one query a
# call: 8 queries 126 ms against faiss' 204, 16 queries 256 against 206)
_MAX_CALLS = 8
INT8_PRODUCTS_MODEL = Path(__file__).resolve().parent / "data" / "int8_products.onnx"


def _available_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


class QuantizedScan:
    """A copy of ``rows`` (N, d) float32, the rows of an inner-product flat index, in ``codec``. ``fp16``:
    in ``chunks`` consecutive parts (default: one a core), so a search can share them among threads;
    ``int8``: one onnxruntime session on ``threads`` threads (default: every core)."""

    def __init__(self, rows: np.ndarray, codec: Codec = "int8", chunks: int | None = None, threads: int | None = None):
        if codec not in CODECS:
            raise ValueError(f"codec {codec!r}: one of {', '.join(CODECS)}")
        self.rows = rows
        self.codec = codec
        self._copy = _Int8Products(rows, threads) if codec == "int8" else _HalfParts(rows, chunks)

    @property
    def nbytes(self) -> int:
        """Memory the copy holds."""
        return self._copy.nbytes

    @property
    def max_queries(self) -> int:
        """The most queries a search of this copy is worth it for: faiss' fp32 matrix product is faster
        past it (fp16, which faiss scores a query at a time: 3; int8: ``_MAX_CALLS`` calls)."""
        if isinstance(self._copy, _Int8Products):
            return _MAX_CALLS * self._copy.queries_per_call
        return BLAS_MIN_QUERIES - 1

    def score_error(self, queries: np.ndarray) -> np.ndarray:
        """Per query, the most a row's score from the copy can differ from its fp32 score."""
        return self._copy.score_error(np.atleast_2d(queries).astype(np.float32))

    def search(self, queries: np.ndarray, k: int, threads: int = 1,
               among: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
        """(scores, row numbers), each (Q, min(k, rows searched)), best first, ties in row order. fp16
        shares its parts among ``threads`` (the calling one and the scan helpers); int8 runs on its
        session's threads. ``among``: only these row numbers (a filter's matches; meant for broad ones:
        the scan reads every row and keeps the candidates among them, taking more in proportion).

        A query whose k-th score is not clear of what the copy left out (it cannot tell the best row it
        left out from it: near-duplicates) is scanned again for four times the candidates."""
        queries = np.ascontiguousarray(np.atleast_2d(queries), dtype=np.float32)
        count = len(self.rows)
        accepted = None
        if among is not None:
            accepted = np.zeros(count, bool)
            accepted[among] = True
        k = min(int(k), count if among is None else len(among))
        scores = np.empty((len(queries), k), np.float32)
        numbers = np.empty((len(queries), k), np.int64)
        todo = np.arange(len(queries)) if k else np.arange(0)
        wanted = 2 * k + EXTRA_CANDIDATES
        if among is not None:  # the candidates kept are the filter's share of those found
            wanted = math.ceil(wanted * count / max(1, len(among)))
        while len(todo):
            candidates, ceiling = self._copy.candidates(queries[todo], wanted, threads)
            found = np.sort(candidates, axis=1)  # -1 (none) first, then row order: ties go to the lower row
            valid = found >= 0
            if accepted is not None:
                valid &= accepted[np.maximum(found, 0)]
            gathered = self.rows[np.maximum(found, 0)]  # (Q, W, d)
            exact = np.where(valid, np.matmul(gathered, queries[todo, :, None])[:, :, 0], -np.inf)
            order = np.argsort(-exact, axis=1, kind="stable")[:, :k]
            best = np.take_along_axis(exact, order, axis=1)
            done = np.isfinite(best[:, -1]) & (ceiling < best[:, -1])
            scores[todo[done]] = best[done]
            numbers[todo[done]] = np.take_along_axis(found, order, axis=1)[done]
            todo, wanted = todo[~done], wanted * 4
        return scores, numbers


def _int8_session(codes: np.ndarray, threads: int):
    """(session, the value it holds) of the shipped graph over ``codes`` (d, N) int8."""
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    opts.intra_op_num_threads = threads
    opts.inter_op_num_threads = 1
    # idle threads sleep: spinning, they would hold the cores the encoder's next call needs
    opts.add_session_config_entry("session.intra_op.allow_spinning", "0")
    # the codes replace the graph's placeholder: a constant, so onnxruntime packs it once for its
    # kernel (twice as fast as a matrix passed with each call); the value and its array must outlive the session
    value = ort.OrtValue.ortvalue_from_numpy(codes)
    opts.add_initializer("codes", value)
    return ort.InferenceSession(str(INT8_PRODUCTS_MODEL), sess_options=opts, providers=["CPUExecutionProvider"]), value


def products_exact(run) -> bool:
    """Whether ``run(queries (2n, d) uint8, codes (d, N) int8) -> (n, N) int32 scores`` (factor 1, every row)
    gives the exact integer products on extreme values: the largest codes and query bytes, where a kernel that
    adds pairs of u8 x s8 products in saturating int16 (x86 without VNNI: pmaddubsw) comes out wrong."""
    rng = np.random.default_rng(0)
    codes = rng.choice(np.array([-128, -127, 127], np.int8), size=(64, 32))
    queries = rng.choice(np.array([0, 1, 255], np.uint8), size=(8, 64))
    products = (queries.astype(np.int64) - 128) @ codes.astype(np.int64)
    return bool(np.array_equal(run(queries, codes), products[:4] + products[4:]))


@functools.cache
def int8_products_exact() -> bool:
    """Whether onnxruntime's u8 x s8 integer product is exact on this CPU (``products_exact``). The int8 copy's
    error bound assumes it is; on CPUs where it is not, the copy is refused (and int8 text towers measure
    lower: ``QuantizedSpec.qualifies`` decides whether they serve)."""

    def run(queries: np.ndarray, codes: np.ndarray) -> np.ndarray:
        session, _value = _int8_session(codes, 1)
        scores, rows = session.run(None, {"queries": queries, "query_zero": np.array(128, np.uint8),
                                          "factor": np.array(1, np.int32), "k": np.array([codes.shape[1]], np.int64)})
        out = np.empty_like(scores)
        np.put_along_axis(out, rows, scores, axis=1)  # TopK sorted them: back in row order
        return out

    return products_exact(run)


class _Int8Products:
    """The rows as int8 codes, x ~ offset + step * code per dimension, scored by onnxruntime."""

    def __init__(self, rows: np.ndarray, threads: int | None):
        if not int8_products_exact():
            raise ValueError("onnxruntime's int8 product is not exact on this CPU (no VNNI: its kernel saturates), "
                             "so the copy's error bound would not hold")
        count, dim = rows.shape
        low = np.full(dim, np.inf, np.float32)
        high = np.full(dim, -np.inf, np.float32)
        for b in range(0, count, _BLOCK):
            block = np.asarray(rows[b:b + _BLOCK], np.float32)
            low, high = np.minimum(low, block.min(axis=0)), np.maximum(high, block.max(axis=0))
        step = np.where(high > low, (high.astype(np.float64) - low) / 255, 1.0)
        # onnxruntime's product takes the collection as its (d, N) right-hand matrix
        self.codes = np.empty((dim, count), np.int8)
        error = np.zeros(dim)  # the most a dimension's decoded value differs from the stored one
        largest = 0.0  # the largest squared row norm
        for b in range(0, count, _CODE_BLOCK):
            block = np.asarray(rows[b:b + _CODE_BLOCK], np.float64)
            levels = np.clip(np.rint((block - low) / step), 0, 255)
            error = np.maximum(error, np.abs(block - (low + levels * step)).max(axis=0))
            self.codes[:, b:b + len(block)] = (levels - 128).T
            largest = max(largest, float(np.einsum("ij,ij->i", block, block).max()))
        self.count = count
        self.step = step
        self.offset = low + 128 * step  # x ~ offset + step * code
        self.error = error
        self.largest_code = np.abs(self.codes.astype(np.int16)).max(axis=1).astype(np.float64)
        # both parts' products summed as factor * coarse + fine in int32: |sum| <= (factor + 1) d 127 128
        self.factor = 1 << int(math.log2((2**31 - 1) / (dim * 127 * 128) - 1))
        self._rounding_per_query_norm = _rounding_per_query_norm(dim, largest)
        self.queries_per_call = max(_MIN_QUERIES_PER_CALL, _SCORES_BYTES // (8 * count))
        self.session, self._codes_value = _int8_session(self.codes, int(threads or _available_cores()))

    @property
    def nbytes(self) -> int:
        return 2 * self.codes.nbytes  # the codes and onnxruntime's packed copy

    def _split(self, queries: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(coarse, fine, scale): q * step ~ scale * (coarse + fine / factor), both int8; and the remainder."""
        weights = queries.astype(np.float64) * self.step
        scale = np.abs(weights).max(axis=1, keepdims=True) / 127
        scale[scale == 0] = 1.0
        coarse = np.rint(weights / scale)
        fine = np.clip(np.rint((weights - coarse * scale) * self.factor / scale), -127, 127)
        remainder = weights - (coarse + fine / self.factor) * scale
        return np.vstack([coarse, fine]) + 128, scale[:, 0] / self.factor, remainder

    def _error(self, queries: np.ndarray, remainder: np.ndarray) -> np.ndarray:
        return (np.abs(queries) @ self.error + np.abs(remainder) @ self.largest_code
                + self._rounding_per_query_norm * np.linalg.norm(queries, axis=1))

    def score_error(self, queries: np.ndarray) -> np.ndarray:
        return self._error(queries, self._split(queries)[2])

    def best(self, queries: np.ndarray, wanted: int) -> tuple[np.ndarray, np.ndarray]:
        """(the copy's scores, row numbers), each (Q, min(wanted, N)), best first."""
        scores, found, _ = self._best(queries, wanted)
        return scores, found

    def _best(self, queries: np.ndarray, wanted: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``best`` and each query's ``score_error``, from one split of the queries."""
        wanted = min(wanted, self.count)
        scores, found, errors = [], [], []
        for b in range(0, len(queries), self.queries_per_call):
            part = queries[b:b + self.queries_per_call]
            both, unit, remainder = self._split(part)
            ints, rows = self.session.run(None, {"queries": both.astype(np.uint8), "query_zero": np.array(128, np.uint8),
                                                 "factor": np.array(self.factor, np.int32),
                                                 "k": np.array([wanted], np.int64)})
            scores.append((part.astype(np.float64) @ self.offset)[:, None] + unit[:, None] * ints)
            found.append(rows)
            errors.append(self._error(part, remainder))
        return np.concatenate(scores), np.concatenate(found), np.concatenate(errors)

    def candidates(self, queries: np.ndarray, wanted: int, threads: int) -> tuple[np.ndarray, np.ndarray]:
        """(row numbers (Q, W), the W best by the copy's scores; per query the highest fp32 score a row left
        out can have: the W-th copy's score plus the error bound, or -inf where W is every row)."""
        scores, found, errors = self._best(queries, wanted)
        left_out = scores[:, -1] + errors if found.shape[1] < self.count else np.full(len(queries), -np.inf)
        return found, left_out


class _HalfParts:
    """The rows in fp16, scored by faiss' scalar quantizer, in consecutive parts."""

    def __init__(self, rows: np.ndarray, chunks: int | None):
        count, dim = rows.shape
        chunks = max(1, min(chunks or _available_cores(), count))
        bounds = np.linspace(0, count, chunks + 1).astype(np.int64)
        self.parts: list[tuple[int, faiss.Index]] = []
        error = np.zeros(dim, np.float32)
        largest = 0.0
        for begin, end in zip(bounds[:-1], bounds[1:]):
            part_rows = np.ascontiguousarray(rows[begin:end], dtype=np.float32)
            if any(float(np.abs(part_rows[b:b + _BLOCK]).max()) > FP16_MAX for b in range(0, len(part_rows), _BLOCK)):
                raise ValueError("the vectors have components beyond fp16's range")
            part = faiss.IndexScalarQuantizer(dim, faiss.ScalarQuantizer.QT_fp16, faiss.METRIC_INNER_PRODUCT)
            part.add(part_rows)
            for b in range(0, len(part_rows), _BLOCK):
                block = part_rows[b:b + _BLOCK]
                error = np.maximum(error, np.abs(part.sa_decode(part.sa_encode(block)) - block).max(axis=0))
                largest = max(largest, float(np.einsum("ij,ij->i", block, block).max()))
            self.parts.append((int(begin), part))
        self.error = error
        self._rounding_per_query_norm = _rounding_per_query_norm(dim, largest)

    @property
    def nbytes(self) -> int:
        return sum(part.sa_code_size() * part.ntotal for _, part in self.parts)

    def score_error(self, queries: np.ndarray) -> np.ndarray:
        return np.abs(queries) @ self.error + self._rounding_per_query_norm * np.linalg.norm(queries, axis=1)

    def candidates(self, queries: np.ndarray, wanted: int, threads: int) -> tuple[np.ndarray, np.ndarray]:
        """Each part's top ``wanted`` rows by the copy's scores (Q, ...), -1 padded, and per query the highest
        fp32 score a row the parts left out can have (-inf where every part gave all its rows)."""
        threads = max(1, min(threads, len(self.parts)))
        groups = [self.parts[i::threads] for i in range(threads)]
        pending = [scan_helpers().submit(_scan_parts, group, queries, wanted) for group in groups[1:]]
        with one_thread():
            found = [_scan_parts(groups[0], queries, wanted)]
        found += [p.result() for p in pending]
        left_out = np.max(np.stack([left_out for _, left_out in found]), axis=0)
        return np.concatenate([rows for rows, _ in found], axis=1), left_out + self.score_error(queries)


def _rounding_per_query_norm(dim: int, largest_squared_norm: float) -> float:
    """The float32 sums' share of the error bound, per unit of query norm: the rescoring's (and the fp16
    kernel's) sums err by at most d * 2^-24 of sum |q_i x_i| <= |q| |x|; four times that."""
    return dim * 2.0 ** -22 * math.sqrt(largest_squared_norm)


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


def int8_products_model() -> bytes:
    """The int8 copy's ONNX graph (shipped as ``data/int8_products.onnx``; writing it needs the ``onnx``
    package of the train extra): queries (2n, d) uint8, coarse parts then fine ones, zero point 128;
    codes (d, N) int8, a placeholder the copy's codes replace; factor int32; k int64[1] -> the top k
    of factor * coarse + fine products, (n, k) int32, and their row numbers (n, k) int64."""
    import onnx
    from onnx import TensorProto, helper

    graph = helper.make_graph(
        [helper.make_node("MatMulInteger", ["queries", "codes", "query_zero"], ["products"]),
         helper.make_node("Split", ["products"], ["coarse", "fine"], axis=0, num_outputs=2),
         helper.make_node("Mul", ["coarse", "factor"], ["coarse_scaled"]),
         helper.make_node("Add", ["coarse_scaled", "fine"], ["all_scores"]),
         helper.make_node("TopK", ["all_scores", "k"], ["scores", "rows"], axis=1, largest=1, sorted=1)],
        "int8_products",
        [helper.make_tensor_value_info("queries", TensorProto.UINT8, ["n2", "d"]),
         helper.make_tensor_value_info("query_zero", TensorProto.UINT8, []),
         helper.make_tensor_value_info("factor", TensorProto.INT32, []),
         helper.make_tensor_value_info("k", TensorProto.INT64, [1])],
        [helper.make_tensor_value_info("scores", TensorProto.INT32, ["n", "k_out"]),
         helper.make_tensor_value_info("rows", TensorProto.INT64, ["n", "k_out"])],
        initializer=[helper.make_tensor("codes", TensorProto.INT8, [1, 1], [0])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], producer_name="paraseek")
    model.ir_version = 8  # what every onnxruntime >= 1.20 reads
    onnx.checker.check_model(model)
    return model.SerializeToString()
