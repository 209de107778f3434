"""Graph fusion at export: what the towers hold after it, that they still compute the same embeddings
(padding included), that a disagreeing fusion is refused, and the int8 policies on the fused graph."""

import shutil

import numpy as np
import onnx
import pytest
from typer.testing import CliRunner

from paraseek.index.quantized_scan import int8_products_exact
from paraseek.core.bundle import read_manifest
from paraseek.core.encoder import Encoder
from paraseek.core.integrity import sha256_file
from paraseek.training.export import graph_optimize
from paraseek.training.export.graph_optimize import FUSED_MIN_COSINE, fused_operators, optimize_bundle
from paraseek.training.export.quantize import fp32_nodes

TEXTS = ["a dog", "two people riding bicycles down a busy city street at night past the shops",
         "A kitchen with a stove, a sink and lots of pots hanging on the wall."]


@pytest.mark.quick
def test_starter_text_tower_is_fused_and_agrees(starter_bundle):
    m = read_manifest(starter_bundle)
    opt = m.text.optimization
    assert opt is not None and opt.tool.startswith("onnxscript")
    # MiniLM has 6 layers: one Attention, one BiasGelu and two skip layer norms each
    assert opt.operators == {"Attention": 6, "BiasGelu": 6, "SkipLayerNormalization": 12}
    assert opt.cosine_vs_exported_min >= FUSED_MIN_COSINE
    graph = onnx.load(str(starter_bundle / m.text.file)).graph
    assert fused_operators(onnx.load(str(starter_bundle / m.text.file))) == opt.operators
    # attention reads the raw mask (mask_index), not a bias computed from it, so int8 can quantise it
    cast = next(n for n in graph.node if n.op_type == "Cast" and list(n.input) == ["attention_mask"])
    for node in (n for n in graph.node if n.op_type == "Attention"):
        assert list(node.input)[3:] == [cast.output[0]]
    # the image tower is a CNN: nothing of the transformer fusions applies, it stays as exported
    assert m.image.optimization is None


@pytest.mark.quick
def test_fused_text_tower_ignores_padding(starter_bundle):
    """A text batched with longer ones (so padded) embeds as it does alone: the mask_index rewrite
    masks the padding exactly as the exported bias did."""
    enc = Encoder(starter_bundle, load_image=False)
    batched = enc.encode_text(TEXTS)
    alone = np.vstack([enc.encode_text([t]) for t in TEXTS])
    assert np.sum(batched * alone, axis=1).min() >= 0.99999


@pytest.mark.quick
def test_int8_quantises_the_fused_attention(starter_bundle):
    m = read_manifest(starter_bundle)
    assert m.text_int8.keep_fp32 == "first-attention+downs"
    ops = [n.op_type for n in onnx.load(str(starter_bundle / m.text_int8.file)).graph.node]
    assert ops.count("Attention") == 1 and ops.count("QAttention") == 5  # the policy keeps the first of six fp32
    if int8_products_exact():  # elsewhere the tower measures other than at release, and is vouched for only if alike
        assert m.text_int8.qualifies()[0], m.text_int8.qualifies()[1]


@pytest.mark.quick
def test_keep_fp32_policies_on_the_fused_graph(starter_bundle):
    path = starter_bundle / read_manifest(starter_bundle).text.file
    graph = onnx.load(str(path)).graph
    kind = {n.name: n.op_type for n in graph.node}
    assert fp32_nodes(path, "none") == []
    (first_down,) = fp32_nodes(path, "first-down")
    kept = fp32_nodes(path, "first-attention+downs")
    assert kind[kept[0]] == "Attention" and [kind[k] for k in kept[1:]] == ["MatMul"] * 6
    assert first_down == kept[1]
    with pytest.raises(ValueError, match="keep_fp32"):
        fp32_nodes(path, "everything")


def _unfused_tiny_clip(tiny_clip, tmp_path):
    from paraseek.training.export.openclip import export_open_clip

    from tests.conftest import TINY_CLIP_CONFIG

    _, _, ckpt = tiny_clip
    out = tmp_path / "unfused"
    export_open_clip("tiny-clip", out, pretrained=str(ckpt), model_config=TINY_CLIP_CONFIG, optimize=False)
    return out


def test_open_clip_towers_fuse_and_agree(tiny_clip, tmp_path):
    bundle = _unfused_tiny_clip(tiny_clip, tmp_path)
    done = optimize_bundle(bundle, TEXTS, any_fusion=True)
    m = read_manifest(bundle)
    assert set(done) == {"text", "image"} and m.text.optimization == done["text"] and m.image.optimization == done["image"]
    for spec in (m.text, m.image):
        assert spec.optimization.cosine_vs_exported_min >= FUSED_MIN_COSINE
        assert spec.optimization.operators.get("SkipLayerNormalization", 0) > 0
    # CLIP's causal attention fuses to MultiHeadAttention (no padding mask: nothing to rewrite)
    assert m.text.optimization.operators.get("MultiHeadAttention", 0) > 0
    assert fused_operators(onnx.load(str(bundle / "text.onnx"))) == m.text.optimization.operators


def test_a_clip_graph_without_a_fused_attention_stays_as_exported(tiny_clip, tmp_path):
    """CLIP's towers fuse only to MultiHeadAttention, layer norms and GELUs (slower than the exported
    graph, which onnxruntime fuses itself at load): by default they stay as exported."""
    bundle = _unfused_tiny_clip(tiny_clip, tmp_path)
    before = {name: sha256_file(bundle / name) for name in ("text.onnx", "image.onnx")}
    assert optimize_bundle(bundle, TEXTS) == {}
    assert {name: sha256_file(bundle / name) for name in before} == before
    m = read_manifest(bundle)
    assert m.text.optimization is None and m.image.optimization is None
    assert not list(bundle.glob("*.fused.onnx"))


def test_a_fusion_that_disagrees_is_not_applied(tiny_clip, tmp_path, monkeypatch):
    bundle = _unfused_tiny_clip(tiny_clip, tmp_path)
    before = sha256_file(bundle / "text.onnx")
    monkeypatch.setattr(graph_optimize, "_agreement", lambda *a: np.array([1.0, 0.99]))
    assert optimize_bundle(bundle, TEXTS, any_fusion=True) == {}
    assert sha256_file(bundle / "text.onnx") == before
    assert read_manifest(bundle).text.optimization is None
    assert not list(bundle.glob("*.fused.onnx"))


def test_models_optimize_fuses_an_old_bundle_and_rebuilds_int8_and_fp16(tiny_clip, tmp_path):
    import onnx

    from paraseek.cli import app
    from paraseek.training.export.fp16 import half_text_tower
    from paraseek.training.export.quantize import quantize_text_tower

    bundle = _unfused_tiny_clip(tiny_clip, tmp_path)
    quantize_text_tower(bundle, TEXTS, keep_fp32="none")
    half_text_tower(bundle, TEXTS)
    reference = Encoder(bundle, load_image=True)
    texts_before = reference.encode_text(TEXTS)
    r = CliRunner().invoke(app, ["models", "optimize", str(bundle), "--any-fusion"])
    assert r.exit_code == 0, r.output
    assert "text tower fused" in r.output and "image tower fused" in r.output
    m = read_manifest(bundle)
    assert m.text.optimization is not None and m.text_int8 is not None
    assert m.text_int8.keep_fp32 == "none"  # re-quantised with the bundle's own policy
    assert np.sum(Encoder(bundle).encode_text(TEXTS) * texts_before, axis=1).min() >= FUSED_MIN_COSINE
    # the fp16 tower is converted again, from the fused graph: it holds the fused operators
    assert m.text_fp16 is not None and "fp16 text tower rebuilt" in r.output
    fp16_ops = {node.op_type for node in onnx.load(str(bundle / m.text_fp16.file)).graph.node}
    assert set(m.text.optimization.operators) <= fp16_ops
    assert np.sum(Encoder(bundle, precision="fp16").encode_text(TEXTS) * texts_before, axis=1).min() >= FUSED_MIN_COSINE
    r = CliRunner().invoke(app, ["models", "optimize", str(bundle), "--any-fusion"])
    assert r.exit_code == 0 and "nothing fused" in r.output


def test_models_optimize_records_the_side_by_side_evaluation(whole_photo_starter_bundle, shared_data, tmp_path):
    """The starter as exported before fusion, fused by the CLI with --eval-*: AO@10 and R@10 of the
    exported and fused text towers recorded side by side, and equal. (The whole-photo image side: the
    evaluation embeds 159 photos, one classifier pass each.)"""
    import paraseek.training.torch_env  # noqa: F401
    from paraseek.cli import app
    from paraseek.training.export.hf_text import export_text_encoder
    from paraseek.training.export.starter import build_starter_modules, lite_preprocess, max_seq_length, starter_image_space

    bundle = tmp_path / "starter"
    bundle.mkdir()
    shutil.copyfile(whole_photo_starter_bundle / "image.onnx", bundle / "image.onnx")
    text, _, model_dir = build_starter_modules()
    export_text_encoder(text.eval(), model_dir / "tokenizer.json", bundle, name="unfused", version="1",
                        image_space=starter_image_space(crop_grid=0), max_tokens=max_seq_length(model_dir),
                        image_preprocess=lite_preprocess(crop_grid=0), optimize=False)
    r = CliRunner().invoke(app, ["models", "optimize", str(bundle),
                                 "--eval-pairs", str(shared_data / "paraphrase" / "cxc_dev_pairs.tsv"),
                                 "--eval-images", str(shared_data / "coco-mini" / "captions_val2017.json")])
    assert r.exit_code == 0, r.output
    evaluation = read_manifest(bundle).text.optimization.evaluation
    assert evaluation.ao_at_10["optimized"] == pytest.approx(evaluation.ao_at_10["exported"], abs=0.01)
    assert evaluation.t2i_r_at_10["optimized"] == pytest.approx(evaluation.t2i_r_at_10["exported"], abs=0.01)
    assert evaluation.loss("exported", "optimized") <= 0.01
