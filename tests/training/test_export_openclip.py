"""open_clip exporter: ONNX vs torch, truncated vs full-length runs, checkpoint path."""

import numpy as np
import torch
from PIL import Image

import paraseek.training.torch_env  # noqa: F401  (torchvision shim before torch-side imports)
import open_clip

from paraseek.core.bundle import read_manifest
from paraseek.core.encoder import Encoder
from paraseek.core.integrity import sha256_file
from paraseek.training.export.openclip import ClipTextTower, open_clip_image_space
from paraseek.training.export.onnx_export import max_abs_diff

TEXTS = ["a dog on a beach", "two people riding bicycles down a busy city street at night", "cat",
         "A kitchen with a stove, a sink and lots of pots hanging on the wall above the counter."]


def test_text_onnx_matches_torch_full_length(tiny_clip):
    bundle, model, _ = tiny_clip
    enc = Encoder(bundle)
    with torch.no_grad():
        ref = model.encode_text(open_clip.get_tokenizer("ViT-B-32")(TEXTS), normalize=True)
    assert max_abs_diff(ref, enc.encode_text(TEXTS)) <= 1e-4


def test_truncated_run_identical_to_full_77_tokens(tiny_clip):
    _, model, _ = tiny_clip
    tower = ClipTextTower(model).eval()
    full = open_clip.get_tokenizer("ViT-B-32")(TEXTS)
    length = int((full != 0).sum(1).max())
    assert length < 77
    with torch.no_grad():
        a = tower(full)
        b = tower(full[:, :length])
        ref = model.encode_text(full, normalize=True)
    assert max_abs_diff(a, b) <= 1e-6
    assert max_abs_diff(a, ref) <= 1e-6


def test_image_onnx_matches_torch(tiny_clip, coco_val, shared_data):
    bundle, model, _ = tiny_clip
    enc = Encoder(bundle)
    files = [im["file_name"] for im in coco_val[0]["images"][:3]]
    images = [Image.open(shared_data / "coco-mini" / "val2017" / f) for f in files]
    pixels = np.stack([enc.preprocess(im) for im in images])
    with torch.no_grad():
        ref = model.encode_image(torch.from_numpy(pixels), normalize=True)
    assert max_abs_diff(ref, enc.encode_images(images)) <= 1e-4


def test_preprocess_matches_open_clip_transform(tiny_clip, coco_val, shared_data):
    bundle, model, _ = tiny_clip
    enc = Encoder(bundle)
    tf = open_clip.image_transform(enc.manifest.image_preprocess.size, is_train=False)
    im = Image.open(shared_data / "coco-mini" / "val2017" / coco_val[0]["images"][0]["file_name"])
    ref = tf(im).numpy()
    # PIL resampling of torchvision vs ours: same algorithm, rounding may differ by a grey level
    assert np.abs(ref - enc.preprocess(im)).mean() < 0.01


def test_checkpoint_changes_image_space_id(tiny_clip):
    bundle, _, ckpt = tiny_clip
    m = read_manifest(bundle)
    assert m.source["pretrained"] == str(ckpt)
    # the image space names the checkpoint's content: another checkpoint would be another space
    assert m.image_space == f"open_clip/tiny-clip/ckpt-{sha256_file(ckpt)[:16]}"
    other = ckpt.with_name("other.pt")
    other.write_bytes(ckpt.read_bytes() + b"\0")
    assert open_clip_image_space("tiny-clip", str(other)) != m.image_space
    assert open_clip_image_space("tiny-clip", None) == "open_clip/tiny-clip/random-init"
    assert m.tokenizer.cleaning == "clip" and m.text.input_names == ["input_ids"]
