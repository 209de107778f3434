"""Exact inner-product search on a GPU through onnxruntime: the collection's vectors stay on the GPU,
and a batch of queries is one Gemm and one TopK there.

For hosts whose GPU faiss cannot search on: the faiss-gpu wheels on PyPI hold kernels for compute
capability 7.0-8.9 only (``faiss_index.gpu_search_works``), so an H100/H200 or a Blackwell card would
scan a flat index on the CPU while onnxruntime-gpu, which the text encoder already uses, runs there.
The graph is tiny and shipped with the package (``data/exact_scan.onnx``, written by ``scan_model``,
which needs the ``onnx`` package of the train extra); the serving path needs only onnxruntime.
"""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np

log = logging.getLogger(__name__)

SCAN_MODEL = Path(__file__).resolve().parent / "data" / "exact_scan.onnx"
# TopK is one kernel launch per call over every score; past this k the CPU's heap is as good
MAX_K = 1024
# the scores of one call (queries x collection, float32) are held on the GPU: 1 GiB at most, so a batch
# of 64 over 10M vectors runs as 3 calls of 26 rather than one of 2.5 GB
MAX_SCORES = 1 << 28


def scan_model() -> bytes:
    """The ONNX graph: queries (n, d) float32, rows (N, d) float32, k int64[1] -> scores (n, k) float32,
    positions (n, k) int64, best first."""
    import onnx
    from onnx import TensorProto, helper

    graph = helper.make_graph(
        [helper.make_node("Gemm", ["queries", "rows"], ["all_scores"], transB=1),
         helper.make_node("TopK", ["all_scores", "k"], ["scores", "positions"], axis=1, largest=1, sorted=1)],
        "exact_scan",
        [helper.make_tensor_value_info("queries", TensorProto.FLOAT, ["n", "d"]),
         helper.make_tensor_value_info("rows", TensorProto.FLOAT, ["N", "d"]),
         helper.make_tensor_value_info("k", TensorProto.INT64, [1])],
        [helper.make_tensor_value_info("scores", TensorProto.FLOAT, ["n", "k_out"]),
         helper.make_tensor_value_info("positions", TensorProto.INT64, ["n", "k_out"])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)], producer_name="paraseek")
    model.ir_version = 8  # what every onnxruntime >= 1.20 reads
    onnx.checker.check_model(model)
    return model.SerializeToString()


def gpu_provider() -> str | None:
    """onnxruntime's CUDA provider where the encoder's default choice has it (its libraries then
    preloaded), else None."""
    from paraseek.core.encoder import choose_providers

    return "CUDAExecutionProvider" if "CUDAExecutionProvider" in choose_providers() else None


def exact_scan_for(rows: np.ndarray | None, use_gpu: bool | None = None) -> ExactScan | None:
    """A GPU scan of a flat index's ``rows`` where onnxruntime has a GPU provider and ``use_gpu`` allows it
    (None: where one is present); None otherwise, or when it fails to start (logged: the CPU searches)."""
    if rows is None or use_gpu is False:
        return None
    provider = gpu_provider()
    if provider is None:
        return None
    try:
        return ExactScan(rows, provider)
    except Exception as exc:  # no device, out of GPU memory: the CPU's search serves
        log.warning("exact search on the GPU through onnxruntime did not start, searching on CPU: %s", exc)
        return None


class ExactScan:
    """Top-k inner products of queries against ``rows`` (positions into ``rows``), computed by onnxruntime
    on ``provider`` with the rows copied to that device once. fp32 throughout, TF32 off: the same
    scores as faiss' flat index, to float rounding."""

    def __init__(self, rows: np.ndarray, provider: str = "CUDAExecutionProvider", device_id: int = 0,
                 max_scores: int = MAX_SCORES):
        import onnxruntime as ort

        self.provider = provider
        self.count, self.dim = rows.shape
        self.queries_per_call = max(1, max_scores // max(1, self.count))
        options: dict = {}
        if provider == "CUDAExecutionProvider":
            # device 0 is the provider's default: naming it makes onnxruntime 1.31 warn of a missing plugin device
            options = {"use_tf32": 0} | ({"device_id": device_id} if device_id else {})
        opts = ort.SessionOptions()
        opts.log_severity_level = 3
        self.session = ort.InferenceSession(str(SCAN_MODEL), sess_options=opts, providers=[(provider, options)])
        if provider not in self.session.get_providers():
            raise RuntimeError(f"onnxruntime could not place the scan on {provider} (its libraries did not load)")
        device = "cuda" if provider == "CUDAExecutionProvider" else "cpu"
        # copied to the device once; each search binds it instead of sending the collection again
        self.rows = ort.OrtValue.ortvalue_from_numpy(np.ascontiguousarray(rows, dtype=np.float32), device, device_id)

    @property
    def on_gpu(self) -> bool:
        return self.provider != "CPUExecutionProvider"

    def search(self, queries: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        """(scores, positions), each (len(queries), min(k, count)), best first."""
        queries = np.ascontiguousarray(np.atleast_2d(queries), dtype=np.float32)
        if queries.shape[1] != self.dim:
            raise ValueError(f"query dim {queries.shape[1]} != {self.dim}")
        step = self.queries_per_call
        if len(queries) > step:
            parts = [self._search(queries[i:i + step], k) for i in range(0, len(queries), step)]
            return np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts])
        return self._search(queries, k)

    def _search(self, queries: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        binding = self.session.io_binding()
        binding.bind_cpu_input("queries", queries)
        binding.bind_ortvalue_input("rows", self.rows)
        binding.bind_cpu_input("k", np.array([min(int(k), self.count)], np.int64))
        binding.bind_output("scores")
        binding.bind_output("positions")
        self.session.run_with_iobinding(binding)
        scores, positions = binding.copy_outputs_to_cpu()
        return scores, positions
