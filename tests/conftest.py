"""Shared fixtures. Test data comes from ../shared/data (the product itself never reads it)."""

from __future__ import annotations

import os

# Before anything imports huggingface_hub: a hub lookup here waits ~50 s before failing.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import json
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
SHARED = Path(os.environ.get("PARASEEK_SHARED_DATA", ROOT.parent / "shared" / "data"))
FIXTURES = Path(__file__).resolve().parent / "fixtures"
TINY_CLIP_CONFIG = FIXTURES / "tiny-clip.json"
COCO_VAL_JSON = SHARED / "coco-mini" / "captions_val2017.json"


@pytest.fixture(scope="session")
def shared_data() -> Path:
    if not SHARED.is_dir():
        pytest.fail(f"test data folder {SHARED} is missing (see README: ../shared/data)")
    return SHARED


@pytest.fixture(scope="session")
def coco_val(shared_data):
    data = json.loads(COCO_VAL_JSON.read_text())
    captions = [a["caption"] for a in data["annotations"]]
    image_ids = np.array([a["image_id"] for a in data["annotations"]])
    return data, captions, image_ids


@pytest.fixture(scope="session")
def starter_bundle(tmp_path_factory) -> Path:
    from training.export.starter import build_starter

    out = tmp_path_factory.mktemp("bundles") / "starter"
    build_starter(out, int8=True)
    return out


@pytest.fixture(scope="session")
def starter_encoder(starter_bundle):
    from core.encoder import Encoder

    return Encoder(starter_bundle)


@pytest.fixture(scope="session")
def tiny_clip(tmp_path_factory):
    """A tiny random-initialised open_clip model, saved as a checkpoint and exported from it."""
    import training.torch_env  # noqa: F401  (torchvision shim before open_clip)
    import torch

    from training.export.openclip import export_open_clip, load_open_clip

    tmp = tmp_path_factory.mktemp("tiny-clip")
    torch.manual_seed(0)
    model, _ = load_open_clip("", model_config=TINY_CLIP_CONFIG)
    ckpt = tmp / "tiny.pt"
    torch.save({"state_dict": model.state_dict()}, ckpt)
    bundle = tmp / "bundle"
    export_open_clip("tiny-clip", bundle, pretrained=str(ckpt), model_config=TINY_CLIP_CONFIG)
    reloaded, _ = load_open_clip("tiny-clip", pretrained=str(ckpt), model_config=TINY_CLIP_CONFIG)
    return bundle, reloaded, ckpt
