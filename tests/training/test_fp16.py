"""`paraseek models fp16`: the half-precision text tower, its recorded agreement, and which precision
`auto` serves on CPU and on a GPU."""

from __future__ import annotations

import shutil

import numpy as np
import pytest
from typer.testing import CliRunner

from paraseek.cli import app
from paraseek.core.bundle import BundleError, read_manifest, resolve_precision, write_manifest
from paraseek.core.demo import demo_captions
from paraseek.core.encoder import Encoder
from paraseek.core.settings import Settings


@pytest.fixture(scope="module")
def fp16_bundle(starter_bundle, tmp_path_factory):
    bundle = tmp_path_factory.mktemp("fp16") / "starter"
    shutil.copytree(starter_bundle, bundle)
    r = CliRunner().invoke(app, ["models", "fp16", str(bundle)])
    assert r.exit_code == 0, r.output
    assert "auto precision on a GPU serves fp16" in " ".join(r.output.split())
    return bundle


def test_fp16_tower_holds_half_weights_and_agrees_with_fp32(fp16_bundle):
    import onnx

    m = read_manifest(fp16_bundle)
    assert m.text_fp16 is not None and m.text_fp16.file in m.files
    graph = onnx.load(str(fp16_bundle / m.text_fp16.file)).graph
    weights = {t.data_type: 0 for t in graph.initializer}
    for t in graph.initializer:
        weights[t.data_type] += int(np.prod(t.dims))
    # the weights are half precision (a float32 weight would have to be a scalar or shape constant)
    assert weights.get(onnx.TensorProto.FLOAT16, 0) > 1_000_000
    assert weights.get(onnx.TensorProto.FLOAT, 0) < 1_000
    # inputs and outputs as the fp32 tower's
    assert [i.name for i in graph.input] == m.text.input_names
    assert graph.output[0].type.tensor_type.elem_type == onnx.TensorProto.FLOAT

    texts = demo_captions()[:20] + ["a man riding a wave on top of a surfboard"]
    fp32 = Encoder(fp16_bundle, precision="fp32", load_image=False).encode_text(texts)
    half = Encoder(fp16_bundle, precision="fp16", load_image=False)
    got = half.encode_text(texts)
    assert half.precision == "fp16" and got.dtype == np.float32
    cos = np.sum(fp32 * got, axis=1)
    assert cos.min() >= 0.999
    assert m.text_fp16.cosine_vs_fp32_min >= 0.999
    # a control: another text's embedding is far from these
    assert float(np.sum(fp32[0] * got[1])) < 0.99


@pytest.mark.quick
def test_auto_serves_fp16_on_a_gpu_only_where_it_agrees(fp16_bundle, tmp_path):
    m = read_manifest(fp16_bundle)
    assert m.text_fp16 is not None
    cpu_choice = "int8" if m.text_int8 is not None and m.text_int8.qualifies()[0] else "fp32"
    assert resolve_precision(m, "auto") == cpu_choice
    assert Encoder(fp16_bundle, precision="auto", load_image=False, providers=["CPUExecutionProvider"]).precision == cpu_choice
    assert resolve_precision(m, "auto", gpu=True) == "fp16"
    assert resolve_precision(m, "fp32", gpu=True) == "fp32"

    # a tower that strays from fp32 on one text is not served by auto
    bundle = tmp_path / "strays"
    shutil.copytree(fp16_bundle, bundle)
    strays = m.text_fp16.model_copy(update={"cosine_vs_fp32_min": 0.995})
    write_manifest(bundle, m.model_copy(update={"text_fp16": strays}))
    assert resolve_precision(read_manifest(bundle), "auto", gpu=True) == "fp32"
    assert "0.99500 < 0.999" in strays.qualifies()[1]


@pytest.mark.quick
def test_fp16_precision_needs_the_tower(starter_bundle):
    assert read_manifest(starter_bundle).text_fp16 is None
    with pytest.raises(BundleError, match="no fp16 text tower.*paraseek models fp16"):
        Encoder(starter_bundle, precision="fp16", load_image=False)
    with pytest.raises(BundleError, match="precision must be one of fp32, fp16, int8 or auto"):
        Encoder(starter_bundle, precision="bf16", load_image=False)
    assert Settings(precision="fp16").precision == "fp16"
    with pytest.raises(ValueError, match="precision"):
        Settings(precision="bf16")


@pytest.mark.quick
def test_fp16_command_names_a_missing_bundle(tmp_path):
    r = CliRunner().invoke(app, ["models", "fp16", str(tmp_path / "nowhere")])
    assert r.exit_code != 0
    assert "nowhere" in r.output and "not a directory" in " ".join(r.output.split())


def test_the_embedded_default_gets_its_fp16_tower_on_a_gpu_host_only(starter_bundle, tmp_path, monkeypatch):
    from paraseek.training import embedded

    settings = Settings(home=tmp_path / "home", starter="plain")
    shutil.copytree(starter_bundle, settings.starter_bundle_dir)  # as built at an earlier (CPU) start
    monkeypatch.setattr(embedded, "on_gpu_host", lambda settings: False)
    bundle, _ = embedded.ensure_embedded_default(settings, progress=False, with_bank=False)
    assert read_manifest(bundle).text_fp16 is None and not (bundle / "text.fp16.onnx").exists()

    monkeypatch.setattr(embedded, "on_gpu_host", lambda settings: True)
    embedded.ensure_embedded_default(settings, progress=False, with_bank=False)
    written = read_manifest(bundle).text_fp16
    assert written is not None and written.qualifies()[0]
    assert resolve_precision(read_manifest(bundle), "auto", gpu=True) == "fp16"
    stamp = (bundle / written.file).stat().st_mtime_ns
    embedded.ensure_embedded_default(settings, progress=False, with_bank=False)  # a warm start writes nothing
    assert (bundle / written.file).stat().st_mtime_ns == stamp
