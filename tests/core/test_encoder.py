"""Execution providers: names, the default order, CUDA libraries preloaded, and what an encoder does
when a GPU provider does not load."""

from __future__ import annotations

import shutil

import onnxruntime as ort
import pytest

from paraseek.core import encoder as encoder_module
from paraseek.core.bundle import BundleError, read_manifest
from paraseek.core.encoder import Encoder, choose_providers, provider_names
from paraseek.core.settings import Settings

GPU_BUILD = ["TensorrtExecutionProvider", "CUDAExecutionProvider", "CPUExecutionProvider"]


def test_provider_names_take_short_and_full_names_in_order():
    assert provider_names(None) is None and provider_names("") is None
    assert provider_names("cuda, CPU") == ["CUDAExecutionProvider", "CPUExecutionProvider"]
    assert provider_names("TensorRT,CUDAExecutionProvider") == ["TensorrtExecutionProvider", "CUDAExecutionProvider"]
    assert Settings(providers="cuda, cpu").providers == "cuda, cpu"
    with pytest.raises(ValueError, match="providers"):
        Settings(providers="cuda;cpu")


def test_a_provider_this_onnxruntime_lacks_is_named():
    with pytest.raises(BundleError, match="CUDAExecutionProvider.*not available"):
        choose_providers(provider_names("cuda"))


def test_tensorrt_is_skipped_without_its_libraries_and_cuda_libraries_are_preloaded(monkeypatch):
    preloads = []
    monkeypatch.setattr(ort, "get_available_providers", lambda: GPU_BUILD)
    monkeypatch.setattr(ort, "preload_dlls", lambda *a, **k: preloads.append(1), raising=False)
    monkeypatch.setattr(encoder_module, "_cuda_preloaded", False)
    monkeypatch.setattr(encoder_module, "_tensorrt_present", lambda: False)
    assert choose_providers() == ["CUDAExecutionProvider", "CPUExecutionProvider"]
    monkeypatch.setattr(encoder_module, "_tensorrt_present", lambda: True)
    assert choose_providers() == GPU_BUILD
    assert choose_providers(["CPUExecutionProvider"]) == ["CPUExecutionProvider"]
    assert len(preloads) == 1  # once per process, and only when a GPU provider is chosen


@pytest.fixture(scope="module")
def bundle_with_fp16(starter_bundle, tmp_path_factory):
    from paraseek.core.demo import demo_captions
    from paraseek.training.export.fp16 import half_text_tower

    bundle = tmp_path_factory.mktemp("providers") / "starter"
    shutil.copytree(starter_bundle, bundle)
    half_text_tower(bundle, demo_captions()[:8])
    return bundle


def test_a_gpu_provider_that_does_not_load_leaves_a_cpu_encoder(bundle_with_fp16, monkeypatch, caplog):
    """onnxruntime runs a session on CPU when the CUDA provider cannot start (no device visible,
    libraries missing); the encoder then serves as on a CPU host: `auto` takes the CPU's tower."""
    m = read_manifest(bundle_with_fp16)
    cpu_choice = "int8" if m.text_int8 is not None and m.text_int8.qualifies()[0] else "fp32"
    # as on a GPU host whose device is not there: the providers are chosen, the session cannot use them
    monkeypatch.setattr(encoder_module, "choose_providers", lambda requested=None: ["CUDAExecutionProvider", "CPUExecutionProvider"])
    enc = Encoder(bundle_with_fp16, precision="auto", load_image=False)
    assert enc.providers == ["CPUExecutionProvider"] and enc.text_providers == ["CPUExecutionProvider"]
    assert not enc.on_gpu and enc.precision == cpu_choice
    assert "did not load" in caplog.text
    forced = Encoder(bundle_with_fp16, precision="fp16", load_image=False)  # an explicit precision stays
    assert forced.precision == "fp16" and forced.providers == ["CPUExecutionProvider"]
