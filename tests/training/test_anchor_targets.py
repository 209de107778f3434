"""Bank anchor targets: a text's own paraphrase set left out of its neighbours, rounds of the mean shift,
and the cache that keeps them per starting tower."""

import numpy as np
import pytest

from paraseek.core.query_vectors import mean_fusion
from paraseek.paraphrase.caption_bank import CaptionBank
from paraseek.training.trainer import _expand_leaving_own_out


@pytest.fixture(autouse=True)
def _nltk(shared_data, monkeypatch):
    # the robust recipe holds WordNet sentences in place (objective.preserve_texts)
    monkeypatch.setenv("NLTK_DATA", str(shared_data / "nltk_data"))


def _unit(rows):
    rows = np.asarray(rows, np.float32)
    return rows / np.linalg.norm(rows, axis=1, keepdims=True)


@pytest.mark.quick
def test_own_set_and_its_rewrites_are_left_out_and_the_nearest_others_kept():
    groups = [["a dog", "a puppy"], ["a cat", "a kitten"], ["a car"]]
    captions = [c for g in groups for c in g]
    # the two dog captions are each other's nearest; the cats come next, the car last
    vectors = _unit([[1, 0.05, 0], [1, -0.05, 0], [0.8, 0.6, 0], [0.7, 0.7, 0], [0, 0, 1]])
    bank = CaptionBank.in_memory(captions, vectors)
    rewrites = {"a dog": (None, "a hound")}
    texts = [*captions, "a hound"]
    plain = np.vstack([vectors, _unit([[1, 0.0, 0.01]])])
    got = _expand_leaving_own_out(bank, groups, rewrites, texts, plain, n=2)
    # "a dog": its own set (itself, "a puppy") out, the two cats in
    np.testing.assert_allclose(got[0], mean_fusion(plain[0], vectors[[2, 3]]), atol=1e-6)
    # the rewrite of "a dog" belongs to its set: the same neighbours
    np.testing.assert_allclose(got[5], mean_fusion(plain[5], vectors[[2, 3]]), atol=1e-6)
    # "a cat": the dogs are nearer than the car, its kitten is its own
    np.testing.assert_allclose(got[2], mean_fusion(plain[2], vectors[[0, 1]]), atol=1e-6)
    # the plain expansion keeps the own set: the dog's nearest are itself and the puppy
    np.testing.assert_allclose(bank.expand(plain[:1], 2)[0], mean_fusion(plain[0], vectors[[0, 1]]), atol=1e-6)


def test_cached_targets_belong_to_the_tower_that_made_them(shared_data, whole_photo_starter_bundle, tmp_path):
    """A run directory reused with another starting tower (or a sweep's shared targets) recomputes the
    targets instead of handing the new tower the first one's."""
    import torch

    from paraseek.training.recipe import load_recipe
    from paraseek.training.trainer import AnchorTargets, Trainer, tower_digest

    head = (shared_data / "coco-captions/train_captions.tsv").read_text().splitlines()[:61]
    (tmp_path / "sets.tsv").write_text("\n".join(head) + "\n")
    spec = load_recipe("robust-starter", [
        f"model.image_bundle={whole_photo_starter_bundle}", "data.image_embeddings=null", f"data.text_captions={tmp_path / 'sets.tsv'}",
        f"data.captions={shared_data / 'coco-mini/captions_train2017.json'}", "data.images=null", "data.text_per_batch=3",
        f"data.paraphrases.dataset={tmp_path / 'para.jsonl'}", "train.batch_size=4", "train.steps=1",
        "objective.preserve_weight=0"])  # the held WordNet sentences (9 s to gather) are not what this test is about
    trainer = Trainer(spec, tmp_path / "run")
    first = trainer.anchor_targets
    text = trainer.data.captions[0][0]
    with torch.no_grad():
        for p in trainer.original.parameters():
            p.mul_(0.9).add_(0.01)  # another starting tower
    assert tower_digest(trainer.original) != tower_digest(trainer.tower)
    again = AnchorTargets.expanded(trainer.original, trainer.data, spec.objective.anchor_bank_n, tmp_path / "run")
    np.testing.assert_allclose(again.plain_of([text]).numpy(), trainer.original.embed([text]), atol=1e-5)
    assert not np.allclose(again.plain_of([text]).numpy(), first.plain_of([text]).numpy(), atol=1e-3)
    (tmp_path / "run2").mkdir()
    same = AnchorTargets.expanded(trainer.tower, trainer.data, spec.objective.anchor_bank_n, tmp_path / "run2")
    np.testing.assert_allclose(same.vectors.numpy(), first.vectors.numpy(), atol=1e-6)  # same tower: same targets
    # two rounds: the once-expanded targets expanded again by the same bank (cached apart from one round's)
    twice = AnchorTargets.expanded(trainer.tower, trainer.data, spec.objective.anchor_bank_n, tmp_path / "run2", rounds=2)
    groups = trainer.data.captions + (trainer.data.text_groups or [])
    captions = list(dict.fromkeys(c for group in groups for c in group))
    bank = CaptionBank.in_memory(captions, same.plain_of(captions).numpy())
    expected = bank.expand(same.vectors.numpy(), spec.objective.anchor_bank_n)
    np.testing.assert_allclose(twice.vectors.numpy(), expected, atol=1e-5)
    assert not np.allclose(twice.vectors.numpy(), same.vectors.numpy(), atol=1e-3)
    assert sorted(p.name for p in (tmp_path / "run2").glob("anchor-targets-*.npz")) == [
        f"anchor-targets-bank{spec.objective.anchor_bank_n}-x2.npz", f"anchor-targets-bank{spec.objective.anchor_bank_n}.npz"]
