"""bench_training on the CPU with a tiny random open_clip tower: the robust-openclip recipe's real steps, the
one-off costs, and a run's projection from the counts the trainer itself uses."""

from __future__ import annotations

import json

import numpy as np
import pytest

from paraseek.loadtests import bench_training
from tests.conftest import TINY_CLIP_CONFIG


@pytest.fixture(autouse=True)
def _nltk(shared_data, monkeypatch):
    monkeypatch.setenv("NLTK_DATA", str(shared_data / "nltk_data"))  # x'' and the held sentences


def test_steps_of_each_batch_size_and_the_run_they_project(shared_data, tmp_path, capsys):
    from paraseek.core.encoder import Encoder
    from paraseek.evaluation.data import read_caption_groups
    from paraseek.paraphrase.caption_bank import CaptionBank
    from paraseek.training.data import read_image_embeddings

    lines = (shared_data / "coco-captions/train_captions.tsv").read_text().splitlines()
    (tmp_path / "sets.tsv").write_text("\n".join(lines[:151]) + "\n")  # header + 150 captions: about 30 text sets
    work = tmp_path / "work"
    argv = ["--model", "tiny-clip", "--model-config", str(TINY_CLIP_CONFIG), "--batch-sizes", "4", "8", "--encode-chunks", "2", "0",
            "--token-cache", "on", "off", "--steps", "2", "--device", "cpu",  # the CPU's rows on any host
            "--warmup", "1", "--max-photos", "20", "--max-bank", "100", "--photos", "1000",
            "--set", f"data.text_captions={tmp_path / 'sets.tsv'}", "--set", "data.text_per_batch=3",
            "--set", "objective.preserve_per_batch=5", "--work", str(work), "--json", str(tmp_path / "r.json")]
    assert bench_training.main(argv) == 0
    out = capsys.readouterr().out
    result = json.loads((tmp_path / "r.json").read_text())
    assert result["photos_in_data"] == 20 and result["bank_captions"] == 100 and result["epochs"] == 3
    assert set(result["one_off"]) == {"export_frozen_bundle_s", "bank_s", "setup_s"}
    sets = json.loads((work / "run/metrics.jsonl").read_text().splitlines()[0])  # the last run's first step
    assert {"anchor", "preserve"} <= set(sets)  # the recipe's terms ran
    rows = result["rows"]
    text_sets = len(read_caption_groups(tmp_path / "sets.tsv"))
    assert [(r["batch_size"], r["encode_chunk"], r["token_cache"]) for r in rows] == [  # side by side
        (b, c, t) for b in (4, 8) for c in (2, 0) for t in ("on", "off")]
    for r in rows:
        assert r["device"] == "cpu" and not r["amp"] and r["step_s"] > 0 and r["peak_gib"] > 0 and r["tokenize_s"] > 0
        assert r["texts_per_step"] == 3 * (r["batch_size"] + 3) + 5
        assert r["texts_per_s"] == pytest.approx(r["texts_per_step"] / r["step_s"])
        want = 3 * max(-(-1000 // r["batch_size"]), -(-text_sets // 3))
        assert r["run_steps"] == want and r["run_minutes"] == pytest.approx(want * r["step_s"] / 60)
    assert f"{rows[4]['run_steps']:>9}" in out and "random unit vectors" in out
    assert [line.split()[2:4] for line in out.splitlines() if line.split()[:1] in (["4"], ["8"])] == [
        [c, t] for _ in (4, 8) for c in ("2", "one") for t in ("on", "off")]
    # the photos and the bank are in the frozen tower's image space, so the trainer took them
    frozen = Encoder(work / "run/base-bundle", load_image=False)
    photos, space = read_image_embeddings(work / "photos.npz")
    assert space == frozen.image_space == CaptionBank.read(work / "bank").manifest.image_space
    np.testing.assert_allclose(np.linalg.norm(photos.vectors, axis=1), 1, atol=1e-5)
    assert len(photos.captions) == 20 and all(len(g) >= 2 for g in photos.captions)


@pytest.mark.quick
def test_texts_per_step_counts_each_photo_and_text_set_three_times_and_the_held_sentences():
    assert bench_training.texts_per_step(80, 18_000, 64, 1024, 256) == 3 * (80 + 256) + 64  # fewer photos than a batch
    assert bench_training.texts_per_step(5000, 10, 0, 1024, 256) == 3 * (1024 + 10)


@pytest.mark.quick
def test_a_recipe_without_a_bank_anchor_is_refused(shared_data, tmp_path, capsys):
    argv = ["--recipe", "paraclip-vitb32", "--model", "tiny-clip", "--model-config", str(TINY_CLIP_CONFIG),
            "--work", str(tmp_path)]
    assert bench_training.main(argv) == 2
    assert "--recipe: paraclip-vitb32 is not an open_clip recipe with a bank anchor" in capsys.readouterr().err
