import json
import shutil

import pytest

from paraseek.core.bundle import BundleError, image_tower_digest, read_manifest
from paraseek.core.encoder import Encoder


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


@pytest.mark.quick
def test_missing_manifest(tmp_path):
    with pytest.raises(BundleError, match="manifest.json is missing"):
        read_manifest(tmp_path)


def test_int8_requires_an_int8_tower(tiny_clip):
    with pytest.raises(BundleError, match="no int8 text tower"):
        Encoder(tiny_clip[0], precision="int8")


@pytest.mark.parametrize("cosine, ao, r10, serves", [
    (0.995, (70.0, 69.8), (74.0, 73.6), "int8"),   # agrees, loses 0.2 and 0.4 points
    (0.995, (70.0, 70.5), (74.0, 74.2), "int8"),   # int8 scored higher
    (0.985, (70.0, 70.0), (74.0, 74.0), "fp32"),   # cosine below 0.99
    (0.995, (70.0, 69.4), (74.0, 74.0), "fp32"),   # AO@10 loses 0.6 points
    (0.995, (70.0, 70.0), (74.0, 73.4), "fp32"),   # R@10 loses 0.6 points
    (0.995, None, None, "fp32"),                   # never evaluated
])
@pytest.mark.quick
def test_auto_precision_serves_int8_only_when_it_agrees_and_loses_nothing(cosine, ao, r10, serves):
    from paraseek.core.bundle import BundleManifest, Int8Evaluation, QuantizedSpec, TokenizerSpec, TowerSpec, resolve_precision

    evaluation = None if ao is None else Int8Evaluation(
        pairs="p.tsv", images="i.json", ao_at_10={"fp32": ao[0], "int8": ao[1]}, t2i_r_at_10={"fp32": r10[0], "int8": r10[1]})
    spec = QuantizedSpec(file="text.int8.onnx", input_names=["input_ids"], cosine_vs_fp32_mean=cosine,
                         cosine_vs_fp32_min=cosine - 0.01, evaluation=evaluation)
    manifest = BundleManifest(name="b", version="1", embedding_dim=8, max_tokens=16, image_space="s",
                              text=TowerSpec(file="text.onnx", input_names=["input_ids"]), text_int8=spec,
                              tokenizer=TokenizerSpec(file="tokenizer.json"))
    assert resolve_precision(manifest, "auto") == serves
    assert resolve_precision(manifest, "fp32") == "fp32" and resolve_precision(manifest, "int8") == "int8"
    assert resolve_precision(manifest.model_copy(update={"text_int8": None}), "auto") == "fp32"


def test_image_tower_digest_names_what_an_image_vector_depends_on(tiny_clip):
    bundle = tiny_clip[0]
    m = read_manifest(bundle)
    digest = image_tower_digest(m)
    assert digest is not None and digest == image_tower_digest(m.model_copy(deep=True))
    # the text towers, the name and the version do not change the photos' vectors
    same = m.model_copy(update={"name": "renamed", "version": "9", "files": {**m.files, m.text.file: "0" * 64}})
    assert image_tower_digest(same) == digest
    other_weights = m.model_copy(update={"files": {**m.files, m.image.file: "f" * 64}})
    other_crop = m.model_copy(update={"image_preprocess": m.image_preprocess.model_copy(update={"size": 192})})
    unnormalised = m.model_copy(update={"normalize": not m.normalize})
    assert len({digest, *map(image_tower_digest, (other_weights, other_crop, unnormalised))}) == 4
    assert image_tower_digest(m.model_copy(update={"image": None})) is None
    assert Encoder(bundle).image_tower_id == digest
    assert Encoder(bundle, load_image=False).image_tower_id is None


@pytest.mark.quick
def test_bundle_digest_tells_a_retrained_bundle_of_the_same_name_and_version_apart(starter_bundle):
    from paraseek.core.bundle import bundle_digest

    m = read_manifest(starter_bundle)
    retrained = m.model_copy(update={"files": {**m.files, m.text.file: "0" * 64}})
    assert bundle_digest(m) == bundle_digest(m.model_copy(deep=True)) != bundle_digest(retrained)
    assert Encoder(starter_bundle, load_image=False).digest == bundle_digest(m)


@pytest.mark.quick
@pytest.mark.parametrize("name", ["../text.onnx", "/etc/passwd", "sub/../../text.onnx"])
def test_a_manifest_naming_files_outside_its_folder_is_refused(starter_bundle, tmp_path, name):
    data = json.loads((starter_bundle / "manifest.json").read_text())
    data["files"][name] = data["files"].pop(data["text"]["file"])
    data["text"]["file"] = name
    (tmp_path / "manifest.json").write_text(json.dumps(data))
    with pytest.raises(BundleError, match="which is not a file inside the bundle folder"):
        read_manifest(tmp_path, verify=False)
