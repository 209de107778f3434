"""`paraseek train` end to end on CPU at tiny sizes, through the same code as real runs."""

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from paraseek.cli import app
from tests.conftest import TINY_CLIP_CONFIG
from tests.whole_photo_starter import whole_photo_bundle  # noqa: F401  (fixture)
from paraseek.training.recipe import RecipeError, list_recipes, load_recipe
from paraseek.training.trainer import Trainer, train

# The runs here train text towers against the starter's whole-photo image side (``starter_bundle`` in this
# module, tests/whole_photo_starter.py): every run embeds its 80 photos, one classifier pass each instead
# of ten; which image side a run is tuned against is not what these tests look at.


@pytest.fixture(autouse=True)
def _nltk(shared_data, monkeypatch):
    monkeypatch.setenv("NLTK_DATA", str(shared_data / "nltk_data"))


def tiny(recipe, shared_data, starter_bundle, *extra):
    """A built-in recipe shrunk to a few steps on the 80 COCO-mini train photos."""
    overrides = [f"data.captions={shared_data / 'coco-mini/captions_train2017.json'}", "data.images=null",
                 "train.batch_size=4", "train.steps=2", "train.checkpoint_every=1", "train.log_every=1"]
    spec = load_recipe(recipe)
    if spec.model.kind != "open_clip":
        overrides.append(f"model.image_bundle={starter_bundle}")
    return load_recipe(recipe, overrides + list(extra))


TINY_OPEN_CLIP = ["model.name=tiny-clip", f"model.config={TINY_CLIP_CONFIG}", "model.pretrained=null",
                  "data.paraphrases.x1=human", "data.paraphrases.x2=wordnet", "train.lr=1e-3"]


@pytest.mark.parametrize("name, extra", [
    ("paraclip-starter-cpu", []),
    ("laclip-starter-cpu", []),
    ("pcclip-starter-cpu", []),
    ("alignment-minilm", ["model.layers=1"]),
    ("paraclip-vitb32", TINY_OPEN_CLIP),
])
def test_every_recipe_runs_and_exports_a_bundle(name, extra, shared_data, starter_bundle, tmp_path, monkeypatch):
    from paraseek.core.encoder import Encoder
    from paraseek.training.export import openclip

    exported: list[str] = []
    export_onnx = openclip.export_onnx
    monkeypatch.setattr(openclip, "export_onnx", lambda module, inputs, path, *a, **k: (
        exported.append(Path(path).relative_to(tmp_path / "run").as_posix()), export_onnx(module, inputs, path, *a, **k))[1])
    result = train(tiny(name, shared_data, starter_bundle, *extra), tmp_path / "run", progress=False)
    assert result.steps == 2 and np.isfinite(result.last_loss)
    enc = Encoder(result.bundle)
    assert enc.has_image_tower  # the frozen image tower ships with the tuned text tower
    base_space = Encoder(starter_bundle).image_space if "starter" in name or "alignment" in name else None
    if base_space:
        assert enc.image_space == base_space  # existing indexes stay valid
    else:  # open_clip: the frozen image tower ships as the run's base bundle exported it, not exported again
        from paraseek.core.bundle import read_manifest

        trained, base = read_manifest(result.bundle), read_manifest(tmp_path / "run/base-bundle")
        assert trained.image == base.image and trained.image_preprocess == base.image_preprocess
        assert trained.files["image.onnx"] == base.files["image.onnx"]
        assert trained.files["text.onnx"] != base.files["text.onnx"]
        assert exported == ["base-bundle/text.onnx", "base-bundle/image.onnx", "bundle/text.onnx"]
    rows = [json.loads(line) for line in (tmp_path / "run/metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    if name == "paraclip-starter-cpu":
        _serves_over_a_snapshot_of_the_frozen_image_tower(result.bundle, starter_bundle, shared_data, tmp_path)


def _serves_over_a_snapshot_of_the_frozen_image_tower(bundle, image_bundle, shared_data, tmp_path):
    """A trained starter tower is served over a snapshot built with the starter's image tower (same
    image_space); training cached plain image embeddings, not an index."""
    from fastapi.testclient import TestClient

    from paraseek.core.encoder import Encoder
    from paraseek.core.settings import Settings
    from paraseek.index.builder import build_snapshot
    from paraseek.service.main import create_app

    assert (tmp_path / "run" / "image-embeddings.npz").is_file() and not (tmp_path / "run" / "image-embeddings").exists()
    snapshot = tmp_path / "snap"
    build_snapshot(shared_data / "coco-mini/captions_train2017.json", Encoder(image_bundle), snapshot, progress=False)
    with TestClient(create_app(Settings(bundle=bundle, snapshot=snapshot, log_json=False))) as c:
        r = c.post("/v1/search", json={"query": "a living room", "k": 3})
        assert r.status_code == 200 and r.json()["bundle"] == "paraclip-starter-cpu"


def test_loss_falls_on_a_fixed_batch(shared_data, starter_bundle, tmp_path):
    spec = tiny("paraclip-vitb32", shared_data, starter_bundle, *TINY_OPEN_CLIP, "train.steps=30", "train.lr=3e-3")
    trainer = Trainer(spec, tmp_path / "run")
    fixed = trainer.loss

    trainer.loss = lambda step: fixed(0)  # the same batch every step
    losses = trainer.fit(progress=False)
    assert losses[-1] < 0.6 * losses[0], (losses[0], losses[-1])


def test_killed_run_resumes_to_the_same_state(shared_data, starter_bundle, tmp_path):
    spec = tiny("paraclip-vitb32", shared_data, starter_bundle, *TINY_OPEN_CLIP, "train.steps=4",
                "objective.learnable_temperature=true")
    straight = Trainer(spec, tmp_path / "a")
    straight.fit(progress=False)
    first = Trainer(spec, tmp_path / "b")
    first.fit(max_steps=2, progress=False)  # "killed" after step 2: only its checkpoint survives
    del first
    resumed = Trainer(spec, tmp_path / "b")
    assert resumed.step == 2
    resumed.fit(progress=False)
    a, b = straight.tower.trainable_state(), resumed.tower.trainable_state()
    assert a.keys() == b.keys() and len(a) > 0
    for k in a:
        assert torch.allclose(a[k], b[k], atol=1e-6), k
    assert float(straight.temperature().detach()) == pytest.approx(float(resumed.temperature().detach()), rel=1e-6)


def test_wise_ft_interpolates_towards_the_original(shared_data, starter_bundle, tmp_path):
    spec = tiny("paraclip-vitb32", shared_data, starter_bundle, *TINY_OPEN_CLIP, "train.wise_ft_alpha=0.25")
    trainer = Trainer(spec, tmp_path / "run")
    # the recipe's optimiser settings reach the optimiser: the paper's weight decay (ParaCLIP's recipe), the lr set here
    assert [(g["weight_decay"], g["initial_lr"]) for g in trainer.optimizer.param_groups] == [(0.001, 1e-3)] * len(
        trainer.optimizer.param_groups)
    before = {k: v.clone() for k, v in trainer.original.state_dict().items()}
    trainer.fit(progress=False)
    tuned = {k: v.clone() for k, v in trainer.tower.trainable_state().items()}
    assert any(not torch.equal(v, before[k]) for k, v in tuned.items() if v.is_floating_point())  # training moved them
    trainer.export()
    for k, v in trainer.tower.trainable_state().items():  # what the bundle was exported from
        if v.is_floating_point():
            torch.testing.assert_close(v, 0.75 * before[k] + 0.25 * tuned[k], rtol=1e-5, atol=1e-6)
        else:
            assert torch.equal(v, tuned[k])


@pytest.mark.parametrize("overrides, message", [
    (["train.lr=-1"], "recipe.train.lr"),
    (["objective.kind=simclr"], "recipe.objective.kind"),
    (["model.kind=alignment", "model.image_bundle=null"], "image_bundle"),
    (["train.unknown_field=3"], "recipe.train.unknown_field"),
    (["model.kind=alignment", "objective.anchor_weight=1"], "anchor_weight"),
    (["objective.kind=laclip", "objective.relation_weight=1"], "relation_weight"),
    (["objective.preserve_weight=1"], "preserve_texts"),
    (["data.paraphrases.x1=wordnet", "data.paraphrases.human_min_cos=0.8"], "recipe.data.paraphrases: Value error, human_min_cos"),
    (["model.kind=alignment", "objective.preserve_texts=wordnet", "objective.preserve_weight=1"], "preserve_weight"),
    (["objective.similarity_weight=1"], "similarity_pairs"),
    (["objective.similarity_per_batch=1"], "recipe.objective.similarity_per_batch"),
    (["train.epochs=null"], "train.epochs: a run needs train.epochs or train.steps"),
])
@pytest.mark.quick
def test_bad_recipes_name_the_field(overrides, message):
    with pytest.raises(RecipeError, match=message.replace(".", r"\.")):
        load_recipe("paraclip-starter-cpu", overrides)
    r = CliRunner().invoke(app, ["train", "paraclip-starter-cpu", *sum((["--set", o] for o in overrides), [])])
    assert r.exit_code == 2 and message in r.output


@pytest.mark.quick
def test_unknown_recipe_lists_builtins():
    r = CliRunner().invoke(app, ["train", "nope"])
    assert r.exit_code == 2 and "paraclip-starter-cpu" in r.output
    assert set(list_recipes()) >= {"paraclip-vitb32", "alignment-minilm", "paraclip-starter-cpu", "laclip-starter-cpu"}


