"""Transformer graph fusions for exported towers, applied once at export instead of at every load.

torch's exporter writes attention, layer norm and GELU as chains of small operators, and
onnxruntime's load-time optimiser fuses only some of them. onnxscript's ORT fusion rewriter
(``optimize_for_ort``) turns the chains into onnxruntime's fused contrib operators (Attention or
MultiHeadAttention, SkipLayerNormalization, BiasGelu), the same kernels onnxruntime's transformer
optimiser targets, for BERT-like and CLIP graphs alike. On the MiniLM text tower that is 6 Attention,
12 SkipLayerNormalization and 6 BiasGelu nodes: about 20 % more texts per second in fp32, and int8
quantisation of the fused attention projections (``quantize.py``).

A fused graph replaces the exported one only when it agrees with it (cosine of the embeddings at
least ``FUSED_MIN_COSINE`` on every probe input) and holds a fused ``Attention`` (the packed-QKV
operator of BERT-like encoders). onnxruntime fuses layer norms and GELUs itself when it loads a
graph, so that is where the gain is: where the rewriter can only produce MultiHeadAttention (CLIP's
causal text tower) or layer norms and GELUs (CLIP's image tower), the fused graph ran 4-10 % slower
than the exported one on 2 cores. ``any_fusion`` keeps those too. (Timing both graphs at export
decided this first, but in an exporting process whose torch threads share the cores it was too noisy
to decide on: MiniLM measured 0.96-1.27x from run to run.) The manifest records what was fused and
how close it stayed (``GraphOptimization``).
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Sequence

import numpy as np

from paraseek.core.bundle import GraphOptimization, TowerSpec, read_manifest, write_manifest
from paraseek.core.encoder import Encoder
from paraseek.training.export.quantize import measure_side_by_side

log = logging.getLogger(__name__)

# a fusion is an algebraic rewrite: anything but float rounding is a bug, and the graph is kept as exported
FUSED_MIN_COSINE = 0.9999
# the fused operator a graph must hold to be kept (unless any_fusion): the one that is faster than the exported graph
WORTH_FUSING = "Attention"
ATTENTION_MASK = "attention_mask"


def fuse_graph(src: Path, dst: Path) -> dict[str, int]:
    """Write ``src`` with onnxruntime's transformer fusions applied to ``dst``; returns how many of
    each fused operator it holds (empty: nothing fused, ``dst`` not written). A text tower with an
    ``attention_mask`` input feeds it to Attention as its mask_index (``attention_mask_as_mask_index``)."""
    import onnx
    import onnx_ir as ir
    import onnx_ir.passes.common  # noqa: F401  (ir.passes.common below)
    from onnxscript.rewriter.ort_fusions import optimize_for_ort

    model, counts = optimize_for_ort(ir.load(str(src)))
    if not any(counts.values()):
        return {}
    proto = ir.to_proto(model)
    if attention_mask_as_mask_index(proto):  # the chain that turned the mask into a bias is dead now
        model = ir.from_proto(proto)
        ir.passes.common.RemoveUnusedNodesPass()(model)
        proto = ir.to_proto(model)
    onnx.save(proto, str(dst))
    return fused_operators(proto)


def fused_operators(model) -> dict[str, int]:
    """How many of each onnxruntime contrib operator (the fused ones) a graph holds."""
    counts: dict[str, int] = {}
    for node in model.graph.node:
        if node.domain == "com.microsoft":
            counts[node.op_type] = counts.get(node.op_type, 0) + 1
    return dict(sorted(counts.items()))


def attention_mask_as_mask_index(model) -> bool:
    """Feed the text tower's ``attention_mask`` to its fused Attention nodes as their ``mask_index``
    (the raw 0/1 mask, int32) instead of the additive bias the exporter computes from it.

    The two are the same attention (padding gets -10000 before the softmax instead of the float
    minimum: both are exactly 0 after it), but only the mask_index form has a quantised counterpart
    (QAttention takes no attention bias), so int8 can quantise the fused QKV projection too. Applied
    only where the bias is a function of ``attention_mask`` alone and Q, K and V are the same width;
    returns whether the graph changed."""
    from onnx import TensorProto, helper

    graph = model.graph
    if ATTENTION_MASK not in {i.name for i in graph.input}:
        return False
    attention = [n for n in graph.node if n.op_type == "Attention" and n.domain == "com.microsoft"
                 and len(n.input) >= 6 and n.input[5] and not n.input[3]]
    if not attention or any(_graph_inputs_behind(graph, n.input[5]) != {ATTENTION_MASK} for n in attention):
        return False
    for node in attention:
        sizes = next((list(a.ints) for a in node.attribute if a.name == "qkv_hidden_sizes"), None)
        if sizes is not None and len(set(sizes)) != 1:
            return False
    mask_index = ATTENTION_MASK + "_int32"
    graph.node.insert(0, helper.make_node("Cast", [ATTENTION_MASK], [mask_index], to=TensorProto.INT32,
                                          name="attention_mask_to_mask_index"))
    for node in attention:
        del node.input[3:]  # mask_index in, past and attention bias out
        node.input.append(mask_index)
        keep = [a for a in node.attribute if a.name != "qkv_hidden_sizes"]
        del node.attribute[:]
        node.attribute.extend(keep)
    return True


def _graph_inputs_behind(graph, tensor: str) -> set[str]:
    """The graph inputs a tensor is computed from (initializers and constants are not inputs)."""
    inputs = {i.name for i in graph.input}
    producers = {out: node for node in graph.node for out in node.output}
    seen, found, stack = set(), set(), [tensor]
    while stack:
        name = stack.pop()
        if name in seen or not name:
            continue
        seen.add(name)
        if name in inputs:
            found.add(name)
        elif name in producers:
            stack.extend(producers[name].input)
    return found


def optimize_bundle(bundle_dir: str | Path, probe_texts: Sequence[str],
                    evaluate_on: tuple[Path, Path] | None = None,
                    any_fusion: bool = False) -> dict[str, GraphOptimization]:
    """Fuse the bundle's fp32 text and image towers in place where the fused graph agrees with the
    exported one: on ``probe_texts`` for the text tower, on seeded random pixels for the image tower
    (a rewrite's error does not depend on what the pixels show). ``evaluate_on`` = (paraphrase pairs,
    images) also measures the exported and fused text towers side by side (AO@10, T2I R@10). Returns
    what was recorded per tower. ``any_fusion``: keep a fused graph that agrees even without a fused
    Attention. Run it before int8 quantisation, which then starts from the fused graph."""
    import onnxscript

    bundle_dir = Path(bundle_dir)
    manifest = read_manifest(bundle_dir)
    if manifest.text_int8 is not None:
        raise ValueError(f"bundle {bundle_dir}: optimise before quantising (its int8 tower was built from the unfused graph)")
    exported = Encoder(bundle_dir, precision="fp32")
    done: dict[str, GraphOptimization] = {}
    fused_files: dict[Path, Path] = {}  # exported file -> its fused candidate, swapped in together at the end
    towers: list[tuple[str, TowerSpec | None]] = [("text", manifest.text), ("image", manifest.image)]
    try:
        for tower, spec in towers:
            if spec is None or spec.optimization is not None:
                continue
            path = bundle_dir / spec.file
            candidate = _candidate_path(path)
            try:
                operators = fuse_graph(path, candidate)
            except Exception as exc:  # an exporter's graph the rewriter does not know: serve it as exported
                log.warning("%s tower: graph fusion failed, kept as exported: %s", tower, exc)
                continue
            if not operators:
                continue
            if WORTH_FUSING not in operators and not any_fusion:
                log.info("%s tower: only %s fused, kept as exported (onnxruntime fuses those at load)", tower,
                         ", ".join(operators))
                continue
            fused = exported.with_text_model(candidate) if tower == "text" else exported.with_image_model(candidate)
            cos = _agreement(exported, fused, tower, probe_texts)
            if float(cos.min()) < FUSED_MIN_COSINE:
                log.warning("%s tower: fused graph disagrees (min cosine %.6f), kept as exported", tower, cos.min())
                continue
            evaluation = None
            if evaluate_on is not None and tower == "text":
                def optimized(fp32: Encoder, fused_path: Path = candidate) -> Encoder:
                    return fp32.with_text_model(fused_path)

                evaluation = measure_side_by_side(bundle_dir, *evaluate_on, {"exported": lambda fp32: fp32,
                                                                              "optimized": optimized})
            fused_files[path] = candidate
            done[tower] = GraphOptimization(
                tool=f"onnxscript {onnxscript.__version__} optimize_for_ort", operators=operators,
                cosine_vs_exported_mean=float(cos.mean()), cosine_vs_exported_min=float(cos.min()), evaluation=evaluation)
            log.info("%s tower fused: %s; cosine to exported mean %.6f min %.6f", tower, operators, cos.mean(), cos.min())
        if done:
            for path, candidate in fused_files.items():
                os.replace(candidate, path)
            update = {tower: getattr(manifest, tower).model_copy(update={"optimization": opt}) for tower, opt in done.items()}
            write_manifest(bundle_dir, manifest.model_copy(update=update))
    finally:  # candidates not swapped in (refused, or the run failed) are not part of the bundle
        for _, spec in towers:
            if spec is not None:
                _candidate_path(bundle_dir / spec.file).unlink(missing_ok=True)
    return done


def _candidate_path(path: Path) -> Path:
    return path.with_name(path.stem + ".fused.onnx")


def _probe_pixels(encoder: Encoder, n: int) -> np.ndarray:
    size = encoder.manifest.image_preprocess.size if encoder.manifest.image_preprocess else 224
    return np.random.default_rng(0).standard_normal((n, 3, size, size)).astype(np.float32)


def _agreement(exported: Encoder, fused: Encoder, tower: str, probe_texts: Sequence[str]) -> np.ndarray:
    if tower == "text":
        return np.sum(exported.encode_text(probe_texts) * fused.encode_text(probe_texts), axis=1)
    pixels = _probe_pixels(exported, 4)
    return np.sum(exported.encode_pixels(pixels) * fused.encode_pixels(pixels), axis=1)
