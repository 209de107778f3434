"""int8 dynamic quantisation of a bundle's text tower, with its agreement to fp32 reported."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Sequence

import numpy as np

from paraseek.core.bundle import Int8Evaluation, QuantizedSpec, read_manifest, write_manifest
from paraseek.core.encoder import Encoder

log = logging.getLogger(__name__)
INT8_FILE = "text.int8.onnx"


def quantize_text_tower(bundle_dir: str | Path, calibration_texts: Sequence[str],
                        evaluate_on: tuple[Path, Path] | None = None,
                        evaluation: Int8Evaluation | None = None) -> QuantizedSpec:
    """Write ``text.int8.onnx`` beside ``text.onnx`` and record it in the manifest.

    Dynamic quantisation: int8 weights for MatMul/Gemm (per output channel), activations quantised on
    the fly, so no calibration data is needed to build it; ``calibration_texts`` only measure the
    cosine agreement with fp32 that goes into the manifest. ``evaluate_on`` = (paraphrase pairs,
    images) measures fp32 and int8 side by side (``measure_int8``); ``paraseek.evaluation`` records one measured
    before (a shipped bundle's, whose weights and quantisation are the same). With neither, ``auto``
    precision keeps fp32 for this bundle.
    """
    from onnxruntime.quantization import QuantType, quantize_dynamic
    from onnxruntime.quantization.shape_inference import quant_pre_process

    bundle_dir = Path(bundle_dir)
    manifest = read_manifest(bundle_dir)
    if manifest.text_int8 is not None:  # quantising again: the old int8 file stops being part of the bundle first
        manifest = write_manifest(bundle_dir, manifest.model_copy(update={"text_int8": None}))
    fp32 = bundle_dir / manifest.text.file
    pre = bundle_dir / "text.preprocessed.onnx"
    out = bundle_dir / INT8_FILE
    try:
        quant_pre_process(str(fp32), str(pre), skip_symbolic_shape=True)
        source = pre
    except Exception as exc:  # pre-processing only helps; quantise the raw graph if it fails
        log.warning("quantisation pre-processing skipped: %s", exc)
        source = fp32
    quantize_dynamic(
        str(source), str(out), weight_type=QuantType.QInt8, per_channel=True,
        op_types_to_quantize=["MatMul", "Gemm"], nodes_to_exclude=sensitive_matmuls(source),
    )
    pre.unlink(missing_ok=True)

    enc = Encoder(bundle_dir, precision="fp32", load_image=False)
    ref = enc.encode_text(calibration_texts)
    got = enc.with_text_model(out).encode_text(calibration_texts)
    cos = np.sum(ref * got, axis=1)
    spec = QuantizedSpec(
        file=INT8_FILE,
        input_names=manifest.text.input_names,
        output_name=manifest.text.output_name,
        cosine_vs_fp32_mean=float(cos.mean()),
        cosine_vs_fp32_min=float(cos.min()),
    )
    write_manifest(bundle_dir, manifest.model_copy(update={"text_int8": spec}))  # the evaluation loads it
    if evaluate_on is not None:
        evaluation = measure_int8(bundle_dir, *evaluate_on)
    if evaluation is not None:
        spec = record_int8_evaluation(bundle_dir, evaluation)
    log.info("int8 text tower: cosine vs fp32 mean %.4f min %.4f; %s", spec.cosine_vs_fp32_mean,
             spec.cosine_vs_fp32_min, spec.qualifies()[1])
    return spec


def record_int8_evaluation(bundle_dir: str | Path, evaluation: Int8Evaluation) -> QuantizedSpec:
    manifest = read_manifest(bundle_dir)
    if manifest.text_int8 is None:
        raise ValueError(f"bundle {bundle_dir} has no int8 text tower to record an evaluation for")
    spec = manifest.text_int8.model_copy(update={"evaluation": evaluation})
    write_manifest(bundle_dir, manifest.model_copy(update={"text_int8": spec}))
    return spec


def sensitive_matmuls(model_path: Path) -> list[str]:
    """The MatMuls kept in fp32: the whole first transformer block and every feed-forward
    down-projection (weight wider in than out). Dynamic int8 quantises activations per tensor, and
    these are the inputs with the longest tails (raw token embeddings; post-GELU activations). On the
    robust starter, quantising everything cost 0.95 point of AO@10 and 1.26 of T2I R@10 on the CxC dev
    pairs; keeping these 13 of 48 in fp32 costs 0.08 and 0.25."""
    import onnx

    graph = onnx.load(str(model_path), load_external_data=False).graph
    shapes = {init.name: list(init.dims) for init in graph.initializer}
    keep, first_block = [], True
    for node in graph.node:  # ONNX stores nodes in topological order
        if node.op_type not in ("MatMul", "Gemm"):
            continue
        weight = next((shapes[i] for i in node.input if i in shapes and len(shapes[i]) == 2), None)
        down = weight is not None and weight[0] > weight[1]
        if first_block or down:
            keep.append(node.name)
        first_block = first_block and not down  # the first down-projection ends the first block
    return keep


def measure_int8(bundle_dir: str | Path, pairs: Path, images: Path) -> Int8Evaluation:
    """AO@10 on paraphrase pairs and T2I R@10 on the images' own captions, fp32 and int8 side by
    side, over one exact snapshot of ``images`` (COCO JSON or folder) built with the bundle's image tower."""
    import tempfile

    from paraseek.evaluation.data import read_pairs
    from paraseek.evaluation.paraphrase import evaluate_pairs
    from paraseek.evaluation.suite import retrieval_on_snapshot
    from paraseek.index.builder import build_snapshot
    from paraseek.index.faiss_index import IndexSpec
    from paraseek.index.snapshot import Snapshot

    pair_list = read_pairs(pairs)
    ao, r10 = {}, {}
    with tempfile.TemporaryDirectory(prefix="paraseek-int8-eval-") as tmp:
        fp32 = Encoder(bundle_dir, precision="fp32")
        build_snapshot(images, fp32, Path(tmp), spec=IndexSpec(type="flat"), progress=False)
        snapshot = Snapshot.load(Path(tmp))
        for precision in ("fp32", "int8"):
            enc = fp32 if precision == "fp32" else Encoder(bundle_dir, precision="int8", load_image=False)
            ao[precision] = 100 * float(evaluate_pairs(enc, snapshot, pair_list, 10, progress=False).ao.mean())
            r10[precision] = float(retrieval_on_snapshot(enc, snapshot)["t2i_r10"])
    return Int8Evaluation(pairs=Path(pairs).name, images=Path(images).name, ao_at_10=ao, t2i_r_at_10=r10)
