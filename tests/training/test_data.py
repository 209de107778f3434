"""Training data: which human caption a caption takes as its x'; image embeddings made once by the frozen
image tower (`paraseek models embed-images`, a recipe's data.image_embeddings, a run's cache)."""

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from paraseek.cli import app
from paraseek.core.errors import UserError
from paraseek.evaluation.data import held_out_texts
from paraseek.training.data import (
    ImageEmbeddings,
    close_captions,
    embed_images,
    load_image_embeddings,
    read_image_embeddings,
    save_image_embeddings,
    without_texts,
)
from paraseek.training.recipe import DataSpec


def _unit(rows):
    rows = np.asarray(rows, np.float32)
    return rows / np.linalg.norm(rows, axis=1, keepdims=True)


@pytest.mark.quick
def test_close_captions_keeps_the_near_ones_and_falls_back_to_the_nearest():
    groups = [["a dog on a sofa", "a puppy on a couch", "a lamp in the corner"], ["a red bus", "a bus stop"],
              ["one", "one"]]
    texts = [t for g in groups for t in g]
    vectors = dict(zip(texts, _unit([[1, 0.1, 0], [1, 0.2, 0], [0, 1, 0.2], [0, 0, 1], [0.3, 0, 1], [1, 1, 1], [1, 1, 1]])))
    got = close_captions(groups, vectors, min_cos=0.9)
    # the dog and the puppy are each other's only close caption; the lamp (another part of the photo) has
    # none above 0.9, so it keeps its nearest, and nobody takes it
    assert got["a dog on a sofa"] == ["a puppy on a couch"] and got["a puppy on a couch"] == ["a dog on a sofa"]
    assert got["a lamp in the corner"] == ["a puppy on a couch"]
    assert got["a red bus"] == ["a bus stop"] and got["a bus stop"] == ["a red bus"]
    assert "one" not in got  # a set of one distinct text has no other caption
    assert close_captions(groups, vectors, min_cos=-1)["a dog on a sofa"] == ["a puppy on a couch", "a lamp in the corner"]


SHIPPED_ASSET = Path(__file__).resolve().parents[2] / "training" / "assets" / "coco_mini_train_starter_images.npz"


def _embeddings():
    rng = np.random.default_rng(0)
    return ImageEmbeddings(np.array([7, 3, 9]), _unit(rng.normal(size=(3, 4))),
                           [["a dog", "a puppy"], ["a bus"], ["a lamp", "a dog"]])


@pytest.mark.parametrize("fp16", [False, True])
@pytest.mark.quick
def test_image_embeddings_round_trip(tmp_path, fp16):
    emb = _embeddings()
    save_image_embeddings(tmp_path / "e.npz", emb, "space-a", fp16=fp16)
    got, space = read_image_embeddings(tmp_path / "e.npz")
    assert space == "space-a" and got.ids.tolist() == [7, 3, 9] and got.captions == emb.captions
    assert got.vectors.dtype == np.float32
    np.testing.assert_allclose(got.vectors, emb.vectors, atol=1e-3 if fp16 else 0)
    assert [p.name for p in tmp_path.iterdir()] == ["e.npz"]  # the temporary file was renamed, not left
    with pytest.raises(UserError, match="image space space-a, the frozen image tower's is space-b"):
        load_image_embeddings(tmp_path / "e.npz", "space-b")


@pytest.mark.quick
def test_image_embeddings_refuse_a_torn_or_foreign_file(tmp_path):
    save_image_embeddings(tmp_path / "e.npz", _embeddings(), "s")
    torn = tmp_path / "torn.npz"
    torn.write_bytes((tmp_path / "e.npz").read_bytes()[:200])
    with pytest.raises(UserError, match="not an image-embeddings .npz"):
        read_image_embeddings(torn)
    np.savez(tmp_path / "other.npz", ids=np.arange(2))
    with pytest.raises(UserError, match="lacks captions, image_space, vectors"):
        read_image_embeddings(tmp_path / "other.npz")
    with pytest.raises(UserError, match="does not exist"):
        read_image_embeddings(tmp_path / "missing.npz")


@pytest.mark.quick
def test_without_texts_drops_evaluation_captions_and_photos_left_bare(tmp_path):
    emb = _embeddings()
    pairs = tmp_path / "pairs.tsv"
    pairs.write_text("caption1\tcaption2\nA dog \ta bus\n")  # case and spaces do not hide a text
    got, dropped = without_texts(emb, held_out_texts([pairs]))
    assert dropped == 3 and got.ids.tolist() == [7, 9] and got.captions == [["a puppy"], ["a lamp"]]
    np.testing.assert_array_equal(got.vectors, emb.vectors[[0, 2]])


def _mini_coco(shared_data, tmp_path, n=3):
    """n COCO-mini val photos with their captions, one more photo whose file is not an image, one without captions."""
    data = json.loads((shared_data / "coco-mini" / "captions_val2017.json").read_text())
    images = data["images"][: n + 2]
    (tmp_path / "val2017").mkdir()
    for im in images[:n]:
        shutil.copy(shared_data / "coco-mini" / "val2017" / im["file_name"], tmp_path / "val2017")
    (tmp_path / "val2017" / images[n]["file_name"]).write_bytes(b"not a jpeg")
    shutil.copy(shared_data / "coco-mini" / "val2017" / images[n + 1]["file_name"], tmp_path / "val2017")
    bare = images[n + 1]["id"]
    annotations = [a for a in data["annotations"] if a["image_id"] in {im["id"] for im in images} and a["image_id"] != bare]
    path = tmp_path / "captions_val2017.json"
    path.write_text(json.dumps({"images": images, "annotations": annotations}))
    return path, images


def test_embed_images_command_skips_what_it_cannot_use(shared_data, starter_bundle, starter_encoder, tmp_path):
    captions, images = _mini_coco(shared_data, tmp_path)
    r = CliRunner().invoke(app, ["models", "embed-images", "--bundle", str(starter_bundle), "--captions", str(captions),
                                 "--out", str(tmp_path / "out.npz")])
    assert r.exit_code == 0, r.output
    assert f"skipped {images[3]['file_name']}" in r.output and f"skipped {images[4]['file_name']}: no captions" in r.output
    got = load_image_embeddings(tmp_path / "out.npz", starter_encoder.image_space)
    assert got.ids.tolist() == [im["id"] for im in images[:3]]
    assert all(len(c) >= 5 for c in got.captions)
    bad = CliRunner().invoke(app, ["models", "embed-images", "--bundle", str(starter_bundle), "--captions", str(captions),
                                   "--out", str(tmp_path / "out.npy")])
    assert bad.exit_code == 2 and "--out" in bad.output


def test_shipped_training_asset_is_what_embed_images_makes(shared_data, starter_bundle, tmp_path):
    """The robust recipe's image term (training/assets/coco_mini_train_starter_images.npz) must be the
    current starter's image side: after a change there, remake it with the command this test runs."""
    pairs = shared_data / "paraphrase"
    r = CliRunner().invoke(app, ["models", "embed-images", "--bundle", str(starter_bundle),
                                 "--captions", str(shared_data / "coco-mini" / "captions_train2017.json"),
                                 "--hold-out", str(pairs / "cxc_dev_pairs.tsv"), "--hold-out", str(pairs / "cxc_dev_scored.tsv"),
                                 "--fp16", "--out", str(tmp_path / "asset.npz")])
    assert r.exit_code == 0, r.output
    assert "2 captions left out" in r.output
    made, made_space = read_image_embeddings(tmp_path / "asset.npz")
    shipped, shipped_space = read_image_embeddings(SHIPPED_ASSET)
    assert made_space == shipped_space
    assert made.ids.tolist() == shipped.ids.tolist() and made.captions == shipped.captions
    np.testing.assert_allclose(made.vectors, shipped.vectors, atol=2e-3)


@pytest.mark.quick
def test_run_cache_is_reused_in_its_image_space_only(shared_data, starter_encoder, tmp_path, monkeypatch):
    captions, _ = _mini_coco(shared_data, tmp_path, n=2)
    run = tmp_path / "run"
    first = embed_images(DataSpec(captions=str(captions)), starter_encoder, run)
    assert first.ids.size == 2 and (run / "image-embeddings.npz").is_file()

    def embed_again(*args, **kwargs):
        raise AssertionError("embedded again")

    import paraseek.training.data as data

    monkeypatch.setattr(data, "embed_photos", embed_again)
    again = embed_images(DataSpec(captions=str(captions)), starter_encoder, run)
    assert again.ids.tolist() == first.ids.tolist() and again.captions == first.captions
    save_image_embeddings(run / "image-embeddings.npz", first, "another-space")
    with pytest.raises(AssertionError, match="embedded again"):
        embed_images(DataSpec(captions=str(captions)), starter_encoder, run)


def test_a_trial_on_the_first_photos_embeds_those_only(shared_data, starter_encoder, tmp_path, monkeypatch):
    import paraseek.training.data as data

    captions, images = _mini_coco(shared_data, tmp_path, n=3)
    embedded = []
    real = data.embed_records

    def counting(encoder, root, records, **kwargs):
        embedded.append(len(records))
        return real(encoder, root, records, **kwargs)

    monkeypatch.setattr(data, "embed_records", counting)
    got = embed_images(DataSpec(captions=str(captions), max_images=2), starter_encoder, tmp_path / "run")
    assert embedded == [2] and got.ids.tolist() == [im["id"] for im in images[:2]]
    assert (tmp_path / "run" / "image-embeddings-first2.npz").is_file()
    whole = embed_images(DataSpec(captions=str(captions)), starter_encoder, tmp_path / "run")
    assert embedded == [2, 4] and whole.ids.size == 3  # the whole set is not the trial's cache; the bad file skipped


@pytest.mark.quick
def test_hold_out_keeps_evaluation_texts_out_of_the_training_data(shared_data, starter_encoder, tmp_path):
    from paraseek.training.data import load_training_data
    from paraseek.training.recipe import ParaphraseSpec

    captions, images = _mini_coco(shared_data, tmp_path, n=3)
    first = json.loads(captions.read_text())["annotations"]
    photo_text = next(a["caption"] for a in first if a["image_id"] == images[0]["id"])
    (tmp_path / "sets.tsv").write_text("image_id\tcaption\n1\ta dog on a sofa\n1\ta puppy on a couch\n1\tA dog asleep\n"
                                       "2\ta red bus\n2\ta bus in a street\n")
    (tmp_path / "pairs.tsv").write_text(f"caption1\tcaption2\n{photo_text.upper()}\ta dog asleep\na red bus\tsomething else\n")
    spec = dict(captions=str(captions), text_captions=str(tmp_path / "sets.tsv"),
                paraphrases=ParaphraseSpec(x1="human", x2="human"))
    held = load_training_data(DataSpec(**spec, hold_out=[str(tmp_path / "pairs.tsv")]), starter_encoder, tmp_path / "run")
    every = load_training_data(DataSpec(**spec), starter_encoder, tmp_path / "run")
    assert any(photo_text in c for c in every.captions) and not any(photo_text in c for c in held.captions)
    assert sum(map(len, every.captions)) - sum(map(len, held.captions)) == 1
    assert every.text_groups == [["a dog on a sofa", "a puppy on a couch", "A dog asleep"], ["a red bus", "a bus in a street"]]
    assert held.text_groups == [["a dog on a sofa", "a puppy on a couch"]]  # the bus set is left with one caption
    with pytest.raises(UserError, match="missing.tsv does not exist"):
        load_training_data(DataSpec(**spec, hold_out=[str(tmp_path / "missing.tsv")]), starter_encoder, tmp_path / "run")
