import json
import shutil

import pytest

from core.bundle import BundleError, read_manifest
from core.encoder import Encoder


@pytest.fixture()
def bundle_copy(tiny_clip, tmp_path):
    bundle, _, _ = tiny_clip
    dst = tmp_path / "b"
    shutil.copytree(bundle, dst)
    return dst


def test_manifest_lists_every_file_with_sha256(tiny_clip):
    m = read_manifest(tiny_clip[0])
    assert set(m.files) == {"text.onnx", "image.onnx", "tokenizer.json"}
    assert all(len(h) == 64 for h in m.files.values())
    assert m.image_space.startswith("open_clip/tiny-clip/ckpt-")
    assert m.max_tokens == 77 and m.embedding_dim == 32


def test_missing_file_is_named(bundle_copy):
    (bundle_copy / "image.onnx").unlink()
    with pytest.raises(BundleError, match="'image.onnx' is missing"):
        Encoder(bundle_copy)


def test_altered_file_is_named(bundle_copy):
    with open(bundle_copy / "tokenizer.json", "a") as f:
        f.write(" ")
    with pytest.raises(BundleError, match="'tokenizer.json' does not match its sha256"):
        read_manifest(bundle_copy)


def test_malformed_manifest(bundle_copy):
    data = json.loads((bundle_copy / "manifest.json").read_text())
    del data["image_space"]
    (bundle_copy / "manifest.json").write_text(json.dumps(data))
    with pytest.raises(BundleError, match="malformed"):
        read_manifest(bundle_copy)


def test_missing_manifest(tmp_path):
    with pytest.raises(BundleError, match="manifest.json is missing"):
        read_manifest(tmp_path)


def test_int8_requires_an_int8_tower(tiny_clip):
    with pytest.raises(BundleError, match="no int8 text tower"):
        Encoder(tiny_clip[0], precision="int8")
