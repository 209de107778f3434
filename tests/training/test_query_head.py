"""Training a caption bank's query head: the targets, the fit, the CLI."""

import numpy as np
import pytest
from typer.testing import CliRunner

from paraseek.core.query_vectors import mean_fusion
from paraseek.paraphrase.query_head import HEAD_FILE, HeadTraining, QueryHead, gelu_tanh
from paraseek.training.query_head import mean_shift_targets, train_query_head


def clustered(n=600, dim=16, clusters=12, spread=0.35, seed=0) -> np.ndarray:
    """Normalised vectors around a few centres: a bank whose mean shift moves each row toward its centre."""
    rng = np.random.default_rng(seed)
    centres = rng.normal(size=(clusters, dim))
    v = centres[rng.integers(0, clusters, n)] + spread * rng.normal(size=(n, dim))
    return (v / np.linalg.norm(v, axis=1, keepdims=True)).astype(np.float32)


@pytest.mark.quick
def test_targets_are_the_mean_shift_with_each_row_left_out_of_its_own_neighbours():
    v = clustered(n=50, dim=8)
    targets = mean_shift_targets(v, neighbours=5, rounds=2, block=7)  # blocks must not change anything
    assert mean_shift_targets(v, 5, 2, rows=np.array([13, 0])) == pytest.approx(targets[[13, 0]], abs=1e-6)
    for i in (0, 13, 49):
        moved = v[i]
        for _ in range(2):
            sims = v @ moved
            sims[i] = -np.inf
            moved = mean_fusion(moved, v[np.argsort(-sims)[:5]])
        assert targets[i] == pytest.approx(moved, abs=1e-5)
    with pytest.raises(ValueError, match="at least two captions"):
        mean_shift_targets(v[:1], 5, 1)


@pytest.mark.quick
def test_the_numpy_activation_is_torchs():
    import torch

    x = np.linspace(-6, 6, 241, dtype=np.float32)
    assert gelu_tanh(x) == pytest.approx(torch.nn.functional.gelu(torch.from_numpy(x), approximate="tanh").numpy(), abs=1e-6)


@pytest.mark.quick
def test_the_head_learns_the_mean_shift_of_captions_it_never_saw():
    v = clustered()
    cfg = HeadTraining(neighbours=8, rounds=2, hidden=64, layers=2, steps=300, batch=64, lr=3e-3, held_out=0.1)
    head = train_query_head(v, cfg)
    c = head.config
    assert isinstance(head, QueryHead) and head.dim == 16 and len(head.weights) == 3
    assert c["held_out_rows"] == 60 and c["neighbours"] == 8 and c["activation"] == "gelu_tanh"
    # on the held-out rows the head's output is nearer the targets than the query itself, by a wide margin
    assert c["held_out_loss"] < 0.5 * c["held_out_identity_loss"]
    assert c["last_loss"] < c["first_loss"]
    fresh = clustered(n=200, seed=0)[-40:]  # the same clusters
    targets = mean_shift_targets(np.vstack([v, fresh]), 8, 2)[-40:]
    assert np.mean(np.sum(head(fresh) * targets, axis=1)) > np.mean(np.sum(fresh * targets, axis=1))
    again = train_query_head(v, cfg)  # seeded: the same head
    assert again.weights[0] == pytest.approx(head.weights[0])


def test_cli_trains_the_head_into_the_bank(starter_bundle, starter_bank, tmp_path, monkeypatch):
    import shutil

    from paraseek.cli import app
    from paraseek.paraphrase.caption_bank import CaptionBank
    from paraseek.paraphrase.expansions import expansion_method

    bank = tmp_path / "bank"
    shutil.copytree(starter_bank.path, bank)
    runner = CliRunner()
    r = runner.invoke(app, ["models", "train-head", "--bundle", str(starter_bundle), "--bank", str(bank),
                            "--steps", "40", "--hidden", "32", "--neighbours", "8", "--rounds", "2"])
    assert r.exit_code == 0, r.output
    assert "query head written to" in r.output and (bank / HEAD_FILE).is_file()
    from paraseek.core.encoder import Encoder

    loaded = CaptionBank.load(bank, Encoder(starter_bundle, load_image=False))
    assert loaded.head is not None and loaded.head.config["steps"] == 40
    assert expansion_method("head").spec_label(expansion_method("head").from_spec(["1"])) == "head+bank64"
    missing = runner.invoke(app, ["models", "train-head", "--bundle", str(starter_bundle), "--bank", str(tmp_path / "none")])
    assert missing.exit_code != 0 and "no caption bank in" in missing.output


@pytest.mark.quick
def test_each_shipped_head_fits_the_mean_shift_of_the_captions_it_held_out():
    """The package's head for the robust starter, on its own shipped bank: on the 2 % of captions it never
    trained on, its output is far nearer their mean shift than the captions themselves are."""
    from dataclasses import fields

    from paraseek.paraphrase.caption_bank import SHIPPED_VECTORS
    from paraseek.training.query_head import held_out_split

    heads = [h for h in sorted(SHIPPED_VECTORS.glob(f"*.{HEAD_FILE}")) if not QueryHead.read(h).config.get("teacher")]
    assert heads, "the package ships the robust starter's query head"
    for path in heads:
        head = QueryHead.read(path)
        vectors = np.load(str(path).removesuffix(HEAD_FILE) + "bank.npy").astype(np.float32)
        cfg = HeadTraining(**{f.name: head.config[f.name] for f in fields(HeadTraining)})
        held, _ = held_out_split(len(vectors), cfg)
        assert head.config["bank_rows"] == len(vectors) and len(held) == head.config["held_out_rows"]
        targets = mean_shift_targets(vectors, cfg.neighbours, cfg.rounds, rows=held)
        before = np.mean(1 - np.sum(vectors[held] * targets, axis=1))
        after = np.mean(1 - np.sum(head(vectors[held]) * targets, axis=1))
        assert after == pytest.approx(head.config["held_out_loss"], abs=2e-3)  # float16 weights as shipped
        assert after < 0.25 * before


def test_a_head_learns_a_teachers_retrieval_vectors(starter_bundle, starter_bank, tiny_clip, tmp_path, shared_data,
                                                    monkeypatch):
    """--teacher: the targets are the teacher's vectors of the bank's captions, moved half way by the
    teacher bank's head, and of two rewritten copies of each caption; the head written into the student's
    bank says what it learnt. A teacher of another image space, a teacher bank without a head, or a
    teacher bank or rewrites without a teacher are refused."""
    import shutil

    from paraseek.cli import app
    from paraseek.core.encoder import Encoder
    from paraseek.paraphrase.caption_bank import CaptionBank
    from paraseek.training.query_head import teacher_targets

    monkeypatch.setenv("NLTK_DATA", str(shared_data / "nltk_data"))  # the rewrites' synonyms
    encoder = Encoder(starter_bundle, load_image=False)
    teacher_bank, student_bank = tmp_path / "teacher", tmp_path / "student"
    shutil.copytree(starter_bank.path, teacher_bank)
    shutil.copytree(starter_bank.path, student_bank)
    cfg = HeadTraining(neighbours=8, rounds=2, hidden=32, steps=60, batch=64, lr=3e-3)
    teacher_head = CaptionBank.load(teacher_bank, encoder).with_head(train_query_head(starter_bank.vectors, cfg)).head
    assert teacher_head is not None
    texts = starter_bank.texts[:5]
    targets = teacher_targets(texts, encoder, teacher_head, 0.5)
    assert targets == pytest.approx(teacher_head(encoder.encode_text(texts), 0.5), abs=1e-5)
    assert teacher_targets(texts, encoder) == pytest.approx(encoder.encode_text(texts), abs=1e-5)

    runner = CliRunner()
    base = ["models", "train-head", "--bundle", str(starter_bundle), "--bank", str(student_bank),
            "--steps", "200", "--hidden", "32", "--teacher", str(starter_bundle)]
    r = runner.invoke(app, base + ["--teacher-bank", str(teacher_bank), "--teacher-blend", "0.5"])
    assert r.exit_code == 0, r.output
    head = CaptionBank.load(student_bank, encoder).head
    assert head is not None and head.config["teacher"].endswith("+ its head@0.5")
    # two copies of each caption but the 8 held out (2 %), which stay unseen in every wording
    assert head.config["bank_rows"] == 400 and head.config["rewrite_rows"] == 2 * (400 - 8)
    assert head.config["held_out_loss"] < head.config["held_out_identity_loss"]
    # the student's head moves its captions toward the teacher's targets
    all_targets = teacher_head(starter_bank.vectors, 0.5)
    assert np.mean(np.sum(head(starter_bank.vectors) * all_targets, 1)) > np.mean(np.sum(starter_bank.vectors * all_targets, 1))

    other_space = runner.invoke(app, base[:-1] + [str(tiny_clip[0])])
    assert other_space.exit_code != 0 and "same image space" in other_space.output
    headless = runner.invoke(app, base + ["--teacher-bank", str(starter_bank.path)])
    assert headless.exit_code != 0 and "with a query head" in headless.output
    no_teacher = runner.invoke(app, base[:-2] + ["--teacher-bank", str(teacher_bank)])
    assert no_teacher.exit_code != 0 and "--teacher-bank: only with a --teacher bundle" in no_teacher.output
    no_teacher = runner.invoke(app, base[:-2] + ["--rewrites", "1"])
    assert no_teacher.exit_code != 0 and "--rewrites: only with a --teacher bundle" in no_teacher.output
    bad_blend = runner.invoke(app, base + ["--teacher-bank", str(teacher_bank), "--teacher-blend", "1.5"])
    assert bad_blend.exit_code != 0 and "blend" in bad_blend.output


def test_the_plain_starters_shipped_head_learnt_the_robust_starters_ranking(starter_encoder):
    """The package's head for the plain starter learnt the robust starter's vector moved all the way by its
    head: on the 2 % of default captions it never trained on (nor any rewrite of them), its output from
    the plain tower's vectors is far nearer those targets than the plain vectors are."""
    from dataclasses import fields

    from paraseek.paraphrase.caption_bank import (DEFAULT_TEXTS, SHIPPED_VECTORS, SUPERSEDED_HEADS, read_caption_texts,
                                                  shipped_head_path)
    from paraseek.training.query_head import held_out_split

    head = QueryHead.read(shipped_head_path(starter_encoder.manifest))
    assert head.config["teacher"] == "paraseek-starter-robust v3 + its head@1"
    assert head.digest not in SUPERSEDED_HEADS  # homes holding the head it replaced get it at their next start
    texts = read_caption_texts(DEFAULT_TEXTS)
    cfg = HeadTraining(**{f.name: head.config[f.name] for f in fields(HeadTraining)})
    held, _ = held_out_split(len(texts), cfg)
    assert head.config["bank_rows"] == len(texts) and len(held) == head.config["held_out_rows"]
    robust = np.load(SHIPPED_VECTORS / "paraseek-starter-robust-v3.bank.npy", mmap_mode="r")
    targets = QueryHead.read(SHIPPED_VECTORS / f"paraseek-starter-robust-v3.{HEAD_FILE}")(
        np.asarray(robust[held], np.float32), 1.0)
    plain = starter_encoder.encode_text([texts[i] for i in held])
    before = np.mean(1 - np.sum(plain * targets, axis=1))
    after = np.mean(1 - np.sum(head(plain) * targets, axis=1))
    assert after == pytest.approx(head.config["held_out_loss"], abs=2e-3)  # float16 weights and bank vectors
    assert after < 0.25 * before
