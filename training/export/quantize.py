"""int8 dynamic quantisation of a bundle's text tower, with its agreement to fp32 reported."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Callable, Sequence

import numpy as np

from paraseek.core.bundle import AgreementEvaluation, Int8Evaluation, QuantizedSpec, read_manifest, write_manifest
from paraseek.core.encoder import Encoder

log = logging.getLogger(__name__)
INT8_FILE = "text.int8.onnx"
# the fused Attention (QKV projection inside) quantises to QAttention; MatMul/Gemm to MatMulInteger
QUANTIZED_OPS = ("MatMul", "Gemm", "Attention")


def quantize_text_tower(bundle_dir: str | Path, calibration_texts: Sequence[str],
                        evaluate_on: tuple[Path, Path] | None = None,
                        evaluation: Int8Evaluation | None = None, keep_fp32: str | None = None) -> QuantizedSpec:
    """Write ``text.int8.onnx`` beside ``text.onnx`` and record it in the manifest.

    Dynamic quantisation: int8 weights for MatMul/Gemm/Attention (per output channel), activations quantised on
    the fly, so no calibration data is needed to build it; ``calibration_texts`` only measure the
    cosine agreement with fp32 that goes into the manifest. ``evaluate_on`` = (paraphrase pairs,
    images) measures fp32 and int8 side by side (``measure_int8``); ``paraseek.evaluation`` records one measured
    before (a shipped bundle's, whose weights and quantisation are the same). With neither, ``auto``
    precision keeps fp32 for this bundle. ``keep_fp32`` (one of ``KEEP_FP32``): which products stay
    fp32; default the policy of the bundle's current int8 tower, else ``DEFAULT_KEEP_FP32``.
    ``"auto"`` (needs ``evaluate_on``) measures the policies fastest first and keeps the first that
    qualifies for ``auto`` precision (the last one if none does).
    """
    if keep_fp32 == "auto":
        if evaluate_on is None:
            raise ValueError("keep_fp32='auto' measures every policy: it needs evaluate_on (pairs, images)")
        for policy in KEEP_FP32:
            spec = quantize_text_tower(bundle_dir, calibration_texts, evaluate_on, keep_fp32=policy)
            if spec.qualifies()[0]:
                break
        return spec

    from onnxruntime.quantization import QuantType, quantize_dynamic
    from onnxruntime.quantization.shape_inference import quant_pre_process

    bundle_dir = Path(bundle_dir)
    manifest = read_manifest(bundle_dir)
    keep_fp32 = keep_fp32 or (manifest.text_int8.keep_fp32 if manifest.text_int8 else None) or DEFAULT_KEEP_FP32
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
        op_types_to_quantize=list(QUANTIZED_OPS), nodes_to_exclude=fp32_nodes(source, keep_fp32),
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
        keep_fp32=keep_fp32,
        cosine_vs_fp32_mean=float(cos.mean()),
        cosine_vs_fp32_min=float(cos.min()),
    )
    write_manifest(bundle_dir, manifest.model_copy(update={"text_int8": spec}))  # the evaluation loads it
    if evaluate_on is not None:
        evaluation = measure_int8(bundle_dir, *evaluate_on)
    if evaluation is not None:
        spec = record_int8_evaluation(bundle_dir, evaluation)
    log.info("int8 text tower (%s kept fp32): cosine vs fp32 mean %.4f min %.4f; %s", keep_fp32,
             spec.cosine_vs_fp32_mean, spec.cosine_vs_fp32_min, spec.qualifies()[1])
    return spec


def record_int8_evaluation(bundle_dir: str | Path, evaluation: Int8Evaluation) -> QuantizedSpec:
    manifest = read_manifest(bundle_dir)
    if manifest.text_int8 is None:
        raise ValueError(f"bundle {bundle_dir} has no int8 text tower to record an evaluation for")
    spec = manifest.text_int8.model_copy(update={"evaluation": evaluation})
    write_manifest(bundle_dir, manifest.model_copy(update={"text_int8": spec}))
    return spec


# Which weight products stay fp32, fastest first. Dynamic int8 quantises activations per tensor,
# and the feed-forward down-projections read the longest tails (post-GELU activations). Measured on
# the fused starters (CxC dev pairs, COCO-mini val; 1 thread, texts/s at batch 1 / 8, fp32 309 / 430):
#   none                   plain loses 0.50 point, robust 1.26       1077 / 962
#   first-down             plain 0.38, robust 1.13                   1033 / 915
#   first-attention+downs  plain 0.13, robust 0.35                    626 / 675
# (every down-projection kept: robust 0.63, slower than the last). Over starter v2's image side
# first-down loses the plain starter 0.50 (R@10), so both starters ship first-attention+downs and record it;
# over v3's (with crops) `--keep-fp32 auto` chooses it for both.
KEEP_FP32 = ("none", "first-down", "first-attention+downs")
DEFAULT_KEEP_FP32 = "first-attention+downs"


def fp32_nodes(model_path: Path, keep_fp32: str) -> list[str]:
    """The names of the MatMul/Gemm/Attention nodes that ``keep_fp32`` leaves unquantised. A
    down-projection is a MatMul whose weight is wider in than out; the first one ends the first block.
    Written for the fused graphs (``graph_optimize``); an unfused one keeps its whole first block
    where a fused one keeps its first Attention node."""
    import onnx

    if keep_fp32 not in KEEP_FP32:
        raise ValueError(f"keep_fp32 must be one of {', '.join(KEEP_FP32)}, not {keep_fp32!r}")
    graph = onnx.load(str(model_path), load_external_data=False).graph
    shapes = {init.name: list(init.dims) for init in graph.initializer}
    fused = any(node.op_type == "Attention" for node in graph.node)
    keep, downs_seen, attention_seen = [], 0, 0
    for node in graph.node:  # ONNX stores nodes in topological order
        if node.op_type not in QUANTIZED_OPS:
            continue
        weight = next((shapes[i] for i in node.input if i in shapes and len(shapes[i]) == 2), None)
        down = node.op_type != "Attention" and weight is not None and weight[0] > weight[1]
        # the first block's attention: its fused node; in an unfused graph (where projections cannot be
        # told apart by shape) the whole first block, the policy measured before fusion
        first_attention = (node.op_type == "Attention" and attention_seen == 0) or (not fused and downs_seen == 0)
        if keep_fp32 == "first-down" and down and downs_seen == 0:
            keep.append(node.name)
        elif keep_fp32 == "first-attention+downs" and (down or first_attention):
            keep.append(node.name)
        downs_seen += down
        attention_seen += node.op_type == "Attention"
    return keep


def measure_int8(bundle_dir: str | Path, pairs: Path, images: Path) -> Int8Evaluation:
    """AO@10 on paraphrase pairs and T2I R@10 on the images' own captions, fp32 and int8 side by side."""
    evaluation = measure_side_by_side(bundle_dir, pairs, images, {
        "fp32": lambda fp32: fp32,
        "int8": lambda fp32: Encoder(bundle_dir, precision="int8", load_image=False),
    })
    return Int8Evaluation.model_validate(evaluation.model_dump())


def measure_side_by_side(bundle_dir: str | Path, pairs: Path, images: Path,
                         text_towers: dict[str, Callable[[Encoder], Encoder]]) -> AgreementEvaluation:
    """AO@10 on paraphrase pairs and T2I R@10 on the images' own captions for each text tower (name ->
    the encoder to measure, made from the bundle's fp32 one), over one exact snapshot of ``images``
    (COCO JSON or folder) built with the bundle's image tower."""
    import tempfile

    from paraseek.evaluation.data import read_pairs
    from paraseek.evaluation.paraphrase import evaluate_pairs
    from paraseek.evaluation.suite import retrieval_on_snapshot
    from paraseek.index.builder import build_snapshot
    from paraseek.index.faiss_index import IndexSpec
    from paraseek.index.snapshot import Snapshot

    pair_list = read_pairs(pairs)
    ao, r10 = {}, {}
    with tempfile.TemporaryDirectory(prefix="paraseek-agreement-") as tmp:
        fp32 = Encoder(bundle_dir, precision="fp32")
        build_snapshot(images, fp32, Path(tmp), spec=IndexSpec(type="flat"), progress=False)
        snapshot = Snapshot.load(Path(tmp))
        for name, make in text_towers.items():
            enc = make(fp32)
            ao[name] = 100 * float(evaluate_pairs(enc, snapshot, pair_list, 10, progress=False).ao.mean())
            r10[name] = float(retrieval_on_snapshot(enc, snapshot)["t2i_r10"])
    return AgreementEvaluation(pairs=Path(pairs).name, images=Path(images).name, ao_at_10=ao, t2i_r_at_10=r10)
