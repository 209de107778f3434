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


@pytest.mark.quick
def test_provider_names_take_short_and_full_names_in_order():
    assert provider_names(None) is None and provider_names("") is None
    assert provider_names("cuda, CPU") == ["CUDAExecutionProvider", "CPUExecutionProvider"]
    assert provider_names("TensorRT,CUDAExecutionProvider") == ["TensorrtExecutionProvider", "CUDAExecutionProvider"]
    assert Settings(providers="cuda, cpu").providers == "cuda, cpu"
    with pytest.raises(ValueError, match="providers"):
        Settings(providers="cuda;cpu")


@pytest.mark.quick
def test_a_provider_this_onnxruntime_lacks_is_named(monkeypatch):
    monkeypatch.setattr(ort, "get_available_providers", lambda: ["CPUExecutionProvider"])  # a CPU build
    with pytest.raises(BundleError, match="CUDAExecutionProvider.*not available"):
        choose_providers(provider_names("cuda"))


@pytest.mark.quick
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


# onnxruntime warns of the asked-for CUDA provider it lacks: the very case under test
@pytest.mark.filterwarnings("ignore:Specified provider 'CUDAExecutionProvider' is not in available provider names")
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


@pytest.mark.quick
def test_preprocess_with_crops_gives_the_whole_photo_then_its_crops_row_by_row():
    import numpy as np
    from PIL import Image
    from pydantic import ValidationError

    from paraseek.core.bundle import ImagePreprocess
    from paraseek.core.encoder import preprocess_image

    rng = np.random.default_rng(0)
    photo = Image.fromarray(rng.integers(0, 256, (60, 80, 3), dtype=np.uint8))
    whole = ImagePreprocess(size=16)
    spec = ImagePreprocess(size=16, crop_grid=3, crop_scale=0.5)
    views = preprocess_image(photo, spec)
    assert spec.views == 10 and views.shape == (10, 3, 16, 16)
    np.testing.assert_array_equal(views[0], preprocess_image(photo, whole))
    # 40 x 30 crops whose origins step 0, 20, 40 across and 0, 15, 30 down
    for i, box in [(1, (0, 0, 40, 30)), (3, (40, 0, 80, 30)), (5, (20, 15, 60, 45)), (9, (40, 30, 80, 60))]:
        np.testing.assert_array_equal(views[i], preprocess_image(photo.crop(box), whole))
    assert preprocess_image(photo, ImagePreprocess(size=16, crop_grid=1, crop_scale=0.5)).shape == (2, 3, 16, 16)
    # a photo a pixel wide still gives every view (a crop is at least one pixel)
    assert preprocess_image(Image.new("RGB", (1, 1)), spec).shape == (10, 3, 16, 16)
    for bad in ({"crop_grid": 5}, {"crop_grid": -1}, {"crop_scale": 1.0}, {"crop_scale": 0.0}):
        with pytest.raises(ValidationError):
            ImagePreprocess(**bad)


def test_a_multi_view_image_tower_runs_a_few_photos_at_a_time(starter_encoder, monkeypatch):
    """Ten views of many photos in one onnxruntime run would peak near 3 GB: encode_pixels runs at most
    VIEWS_PER_RUN views at a time, and the vectors are the ones a run per photo gives."""
    import numpy as np

    views = starter_encoder.manifest.image_preprocess.views
    assert views == 10
    pixels = np.random.default_rng(0).standard_normal((4, views, 3, 224, 224)).astype(np.float32)
    one_by_one = np.concatenate([starter_encoder.encode_pixels(pixels[i : i + 1]) for i in range(4)])
    session = starter_encoder._image_session
    runs = []

    class Recording:
        def run(self, names, feeds):
            runs.append(feeds["pixel_values"].shape[0])
            return session.run(names, feeds)

    monkeypatch.setattr(starter_encoder, "_image_session", Recording())
    monkeypatch.setattr(encoder_module, "VIEWS_PER_RUN", 30)
    together = starter_encoder.encode_pixels(pixels)
    assert runs == [3, 1]
    np.testing.assert_allclose(together, one_by_one, atol=1e-5)
