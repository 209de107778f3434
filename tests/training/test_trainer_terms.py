"""`paraseek train`'s data and objective options, each in a short run on CPU at tiny sizes: human
paraphrases as x', text-only caption sets, an open_clip tower with a bank of the user's captions or photos
embedded beforehand, and the preserve, similarity and similarity-structure terms."""

import json

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from paraseek.cli import app
from paraseek.core.errors import UserError
from tests.conftest import TINY_CLIP_CONFIG
from tests.training.test_trainer import TINY_OPEN_CLIP, _nltk, tiny  # noqa: F401  (_nltk: fixture)
from tests.whole_photo_starter import whole_photo_bundle  # noqa: F401  (fixture; see test_trainer)
from paraseek.training.recipe import load_recipe
from paraseek.training.trainer import Trainer, train


def test_human_min_cos_gives_each_caption_a_close_x1(shared_data, starter_bundle, tmp_path):
    """data.paraphrases.human_min_cos: a caption's x' is another caption of its photo that the frozen tower
    puts within that cosine of it (its nearest where none is), in every batch the run samples."""
    from paraseek.training.data import sample_batch

    spec = tiny("paraclip-starter-cpu", shared_data, starter_bundle, "data.paraphrases.human_min_cos=0.8",
                "data.paraphrases.dataset=" + str(tmp_path / "para.jsonl"))
    trainer = Trainer(spec, tmp_path / "run")
    choices = trainer.x1_choices
    assert set(choices) == {c for g in trainer.data.captions for c in g}
    vectors = dict(zip(list(choices), trainer.original.embed(list(choices))))
    for caption, close in choices.items():
        others = [c for g in trainer.data.captions if caption in g for c in g if c != caption]
        cos = {c: float(vectors[caption] @ vectors[c]) for c in others}
        assert close == ([c for c in others if cos[c] >= 0.8] or [max(others, key=cos.get)])
    fewer = sum(len(v) for v in choices.values()) / len(choices)
    assert 1 <= fewer < 4  # five captions a photo: the filter keeps some of the four others
    for step in range(3):
        batch = sample_batch(trainer.data, step, 4, 0, True, 0, choices)
        assert all(para in choices[caption] for caption, para in zip(batch.x, batch.x1))
    assert np.isfinite(trainer.fit(progress=False)).all()


def test_text_only_caption_sets_feed_l2_l3(shared_data, starter_bundle, tmp_path):
    """COCO train_captions.tsv: paraphrase sets without photos join the text-text terms."""
    from paraseek.training.data import sample_batch

    spec = tiny("paraclip-starter-cpu", shared_data, starter_bundle,
                f"data.text_captions={shared_data / 'coco-captions/train_captions.tsv'}", "data.text_per_batch=3",
                "data.paraphrases.dataset=" + str(tmp_path / "para.jsonl"))
    trainer = Trainer(spec, tmp_path / "run")
    assert len(trainer.data.text_groups) > 3000
    batch = sample_batch(trainer.data, 0, 4, 0, True, 3)
    assert len(batch.images) == 4 and len(batch.x) == len(batch.x1) == len(batch.x2) == 7
    losses = trainer.fit(progress=False)
    assert len(losses) == 2 and all(np.isfinite(losses))


def test_robust_recipe_on_an_open_clip_tower_with_a_bank_of_the_users_captions(tiny_clip, shared_data, starter_bundle,
                                                                                 tmp_path, monkeypatch):
    """robust-openclip: a bank built by `paraseek models build-bank` with the frozen tower's bundle sets
    the anchor targets (eq. 5 mean over its nearest captions), the run trains and exports; a bank of
    another image space is refused naming the field. Then the README's serving steps for the trained tower:
    its own bank with a query head, and the frozen tower's bank with a head taught the trained tower's
    ranking (`train-head --teacher`), so the frozen tower's embeddings stay as they were."""
    from paraseek.core.encoder import Encoder
    from paraseek.paraphrase.caption_bank import CaptionBank

    monkeypatch.setenv("NLTK_DATA", str(shared_data / "nltk_data"))  # x'' and the held sentences
    bundle, _, ckpt = tiny_clip
    groups = [f"{i}\t{c}" for i, g in enumerate((("a dog on a sofa", "a puppy on a couch"), ("a red bus", "a bus in a street"),
                                                  ("two cats", "a pair of kittens"))) for c in g]
    (tmp_path / "sets.tsv").write_text("image_id\tcaption\n" + "\n".join(groups) + "\n")
    (tmp_path / "mine.txt").write_text("a dog asleep\na bus stop\na kitten\na cat on a bed\na street at night\n")
    r = CliRunner().invoke(app, ["models", "build-bank", "--bundle", str(bundle), "--captions", str(tmp_path / "mine.txt"),
                                 "--out", str(tmp_path / "bank")])
    assert r.exit_code == 0, r.output
    common = ["model.name=tiny-clip", f"model.config={TINY_CLIP_CONFIG}", f"model.pretrained={ckpt}",
              f"data.text_captions={tmp_path / 'sets.tsv'}", "data.text_per_batch=2", "objective.anchor_bank_n=2",
              "data.paraphrases.dataset=" + str(tmp_path / "para.jsonl"), "train.lr=1e-3"]
    spec = tiny("robust-openclip", shared_data, starter_bundle, *common, f"objective.anchor_bank={tmp_path / 'bank'}")
    trainer = Trainer(spec, tmp_path / "run")
    bank = CaptionBank.read(tmp_path / "bank")
    texts = ["a puppy on a couch", trainer.data.captions[0][0]]
    want = bank.expand(trainer.original.embed(texts), 2)
    np.testing.assert_allclose(trainer.anchor_targets.of(texts).numpy(), want, atol=2e-3)  # bank vectors are fp16
    losses = trainer.fit(progress=False)
    logged = json.loads((tmp_path / "run/metrics.jsonl").read_text().splitlines()[-1])
    # the starter's objective: the bank anchor and the WordNet sentences held (objective.preserve_texts)
    assert len(losses) == 2 and all(np.isfinite(losses)) and {"anchor", "preserve"} <= set(logged)
    trained = trainer.export()
    assert trained.joinpath("manifest.json").is_file()

    captions = tmp_path / "bank-captions.txt"  # enough captions for a head's held-out split
    lines = (shared_data / "coco-captions/train_captions.tsv").read_text().splitlines()[1:201]
    captions.write_text("\n".join(line.split("\t")[-1] for line in lines) + "\n")
    small = ["--neighbours", "4", "--rounds", "2", "--hidden", "16", "--steps", "200"]
    for which, out in ((trained, "robust"), (bundle, "frozen")):
        r = CliRunner().invoke(app, ["models", "build-bank", "--bundle", str(which), "--captions", str(captions),
                                     "--out", str(tmp_path / out)])
        assert r.exit_code == 0, r.output
    r = CliRunner().invoke(app, ["models", "train-head", "--bundle", str(trained), "--bank", str(tmp_path / "robust"), *small])
    assert r.exit_code == 0, r.output
    r = CliRunner().invoke(app, ["models", "train-head", "--bundle", str(bundle), "--bank", str(tmp_path / "frozen"), *small,
                                 "--teacher", str(trained), "--teacher-bank", str(tmp_path / "robust"), "--rewrites", "1"])
    assert r.exit_code == 0, r.output
    frozen, taught = Encoder(bundle, load_image=False), Encoder(trained, load_image=False)
    robust_bank, frozen_bank = CaptionBank.load(tmp_path / "robust", taught), CaptionBank.load(tmp_path / "frozen", frozen)
    assert robust_bank.head is not None and frozen_bank.head is not None
    assert frozen_bank.head.config["teacher"] == f"{taught.name} v{taught.version} + its head@1"
    # the frozen tower's captions, moved by the taught head, come nearer the trained tower's ranking vectors
    targets = robust_bank.head(robust_bank.vectors)
    before = np.mean(np.sum(frozen_bank.vectors * targets, 1))
    assert np.mean(np.sum(frozen_bank.head(frozen_bank.vectors) * targets, 1)) > before
    # and the frozen tower as the trained one's first-answer bundle (`lead_margin`): one image space, one index
    from paraseek.index.builder import build_snapshot

    build_snapshot(shared_data / "coco-mini/captions_train2017.json", Encoder(trained), tmp_path / "snap", progress=False)
    pairs = (shared_data / "paraphrase/cxc_dev_pairs.tsv").read_text().splitlines()[:21]
    (tmp_path / "pairs.tsv").write_text("\n".join(pairs) + "\n")
    r = CliRunner().invoke(app, ["eval", "paraphrase", "--pairs", str(tmp_path / "pairs.tsv"), "--snapshot", str(tmp_path / "snap"),
                                 "--bundle", str(trained), "--bank", str(tmp_path / "robust"), "--first-answer-bundle",
                                 str(bundle), "--expansion", "bank:4", "--expansion", "bank:4:lead0", "--out", str(tmp_path / "lead")])
    assert r.exit_code == 0, r.output
    import csv

    from paraseek.evaluation.data import read_pairs
    from paraseek.index.snapshot import Snapshot

    with open(tmp_path / "lead/pairs.csv") as f:
        rows = list(csv.DictReader(f))
    led, unled = ([int(row[f"{label}_top10_1"].split()[0]) for row in rows] for label in ("bank4-mean-lead0", "bank4-mean"))
    queries = [a for a, _ in read_pairs(tmp_path / "pairs.tsv")]
    _, frozen_first = Snapshot.load(tmp_path / "snap").search_ids(frozen.encode_text(queries), 1)
    assert led == frozen_first[:, 0].tolist() != unled  # margin 0: the frozen tower's first answer leads every list

    r = CliRunner().invoke(app, ["models", "build-bank", "--bundle", str(starter_bundle), "--captions",
                                 str(tmp_path / "mine.txt"), "--out", str(tmp_path / "starter-bank")])
    assert r.exit_code == 0, r.output
    with pytest.raises(UserError, match="objective.anchor_bank: .*image space"):
        Trainer(tiny("robust-openclip", shared_data, starter_bundle, *common,
                     f"objective.anchor_bank={tmp_path / 'starter-bank'}"), tmp_path / "run2")


def test_an_open_clip_run_trains_on_photos_embedded_beforehand(tiny_clip, shared_data, starter_bundle, tmp_path):
    """README's flow for a team with its own CLIP: `paraseek models embed-images` with the frozen tower's bundle,
    then the recipe with data.image_embeddings; the starter's embeddings (another image space) are refused."""
    bundle, _, ckpt = tiny_clip
    photos = str(shared_data / "coco-mini" / "captions_train2017.json")
    for which, out in ((bundle, "clip.npz"), (starter_bundle, "starter.npz")):
        r = CliRunner().invoke(app, ["models", "embed-images", "--bundle", str(which), "--captions", photos,
                                     "--out", str(tmp_path / out)])
        assert r.exit_code == 0 and "80 photos embedded" in r.output, r.output
    overrides = [*TINY_OPEN_CLIP, f"model.pretrained={ckpt}", "data.captions=null",
                 "data.paraphrases.dataset=" + str(tmp_path / "para.jsonl")]
    spec = tiny("paraclip-vitb32", shared_data, starter_bundle, *overrides, f"data.image_embeddings={tmp_path / 'clip.npz'}")
    result = train(spec, tmp_path / "run", progress=False)
    assert result.steps == 2 and np.isfinite(result.last_loss)
    assert not list((tmp_path / "run").glob("image-embeddings*.npz"))  # nothing embedded again
    with pytest.raises(UserError, match="data.image_embeddings: .*starter.npz is in image space starter/"):
        Trainer(tiny("paraclip-vitb32", shared_data, starter_bundle, *overrides,
                     f"data.image_embeddings={tmp_path / 'starter.npz'}"), tmp_path / "run2")


def test_the_similarity_structure_term_trains_and_is_logged(shared_data, starter_bundle, tmp_path):
    """relation_weight: the term compares the tuned tower's cosines among the batch's captions with the
    frozen tower's; with the bank anchor it reads the frozen embeddings kept beside the targets."""
    head = (shared_data / "coco-captions/train_captions.tsv").read_text().splitlines()[:61]
    (tmp_path / "sets.tsv").write_text("\n".join(head) + "\n")
    spec = tiny("robust-starter", shared_data, starter_bundle, "objective.relation_weight=50", "data.text_per_batch=3",
                "data.image_embeddings=null", f"data.text_captions={tmp_path / 'sets.tsv'}",
                "data.paraphrases.dataset=" + str(tmp_path / "para.jsonl"))
    trainer = Trainer(spec, tmp_path / "run")
    texts = [trainer.data.captions[0][0], trainer.data.captions[1][0]]
    np.testing.assert_allclose(trainer.anchor_targets.plain_of(texts).numpy(), trainer.original.embed(texts), atol=1e-5)
    losses = trainer.fit(progress=False)
    rows = [json.loads(line) for line in (tmp_path / "run/metrics.jsonl").read_text().splitlines()]
    assert len(losses) == 2 and all(np.isfinite(losses)) and all(r["relation"] >= 0 for r in rows)


def test_the_preserve_term_keeps_general_sentences_where_the_frozen_tower_had_them(shared_data, starter_bundle, tmp_path,
                                                                                   monkeypatch):
    """preserve_texts/preserve_weight: trained hard on captions, a tower with the term moves WordNet's
    sentences less from the frozen tower's embeddings than the same run without it."""
    monkeypatch.setenv("NLTK_DATA", str(shared_data / "nltk_data"))
    from paraseek.paraphrase.wordnet import general_sentences

    probe = general_sentences()[::2000]  # sentences the term may or may not have sampled
    drift = {}
    for weight in (0, 100):
        extra = [f"objective.preserve_weight={weight}", "objective.preserve_texts=wordnet", "objective.preserve_per_batch=16"]
        spec = tiny("paraclip-starter-cpu", shared_data, starter_bundle, "train.lr=1e-3", "train.steps=3", *extra)
        trainer = Trainer(spec, tmp_path / f"run{weight}")
        trainer.fit(progress=False)
        trainer.tower.eval()
        with torch.no_grad():
            drift[weight] = float((1 - (trainer.tower.encode(probe) * trainer.original.encode(probe)).sum(-1)).mean())
        if weight:
            rows = [json.loads(line) for line in (tmp_path / f"run{weight}/metrics.jsonl").read_text().splitlines()]
            assert all(r["preserve"] >= 0 for r in rows)
    assert 0 <= drift[100] < 0.6 * drift[0]  # 0.019 against 0.046 when written


@pytest.mark.quick
def test_preserve_texts_reads_a_file_of_the_users_sentences(tmp_path):
    """objective.preserve_texts: besides 'wordnet', a file of sentences from the domain whose similarities
    the run must keep (one per line, duplicates and blanks dropped); a missing file names the field."""
    from paraseek.training.trainer import preserved_sentences

    (tmp_path / "mine.txt").write_text("Stocks fell sharply on Monday.\n\nA man is playing a guitar.\nStocks fell sharply on Monday.\n")
    assert preserved_sentences(str(tmp_path / "mine.txt")) == ["Stocks fell sharply on Monday.", "A man is playing a guitar."]
    with pytest.raises(UserError, match="objective.preserve_texts: .*missing.txt"):
        preserved_sentences(str(tmp_path / "missing.txt"))
    spec = load_recipe("robust-starter", [f"objective.preserve_texts={tmp_path / 'mine.txt'}"])
    assert spec.objective.preserve_texts == str(tmp_path / "mine.txt")


def test_the_similarity_term_learns_graded_scores(shared_data, starter_bundle, tmp_path):
    """similarity_pairs/similarity_weight: trained on STS-B's training pairs, the tower orders those pairs'
    cosines closer to their gold scores than the same run without the term; a file that is not STS-B
    format names the field."""
    from scipy.stats import spearmanr

    from paraseek.evaluation.data import read_sts

    pairs = read_sts(shared_data / "sts/sts-train.csv")[:48]
    (tmp_path / "pairs.csv").write_text("".join(f"g\tf\ty\t{i}\t{p.score}\t{p.a}\t{p.b}\n" for i, p in enumerate(pairs)))
    rho = {}
    for weight in (0, 5):
        extra = [f"objective.similarity_weight={weight}", f"objective.similarity_pairs={tmp_path / 'pairs.csv'}",
                 "objective.similarity_per_batch=48"]
        spec = tiny("paraclip-starter-cpu", shared_data, starter_bundle, "train.lr=1e-3", "train.steps=3", *extra)
        trainer = Trainer(spec, tmp_path / f"run{weight}")
        trainer.fit(progress=False)
        trainer.tower.eval()
        with torch.no_grad():
            cos = (trainer.tower.encode([p.a for p in pairs]) * trainer.tower.encode([p.b for p in pairs])).sum(-1)
        rho[weight] = spearmanr(cos.numpy(), [p.score for p in pairs]).statistic
        if weight:
            rows = [json.loads(line) for line in (tmp_path / f"run{weight}/metrics.jsonl").read_text().splitlines()]
            assert all(r["similarity"] >= 0 for r in rows)
    assert rho[5] > rho[0] + 0.03
    (tmp_path / "bad.csv").write_text("just one sentence per line\n")
    with pytest.raises(UserError, match="objective.similarity_pairs: .*bad.csv has no STS pairs"):
        Trainer(tiny("paraclip-starter-cpu", shared_data, starter_bundle, "objective.similarity_weight=1",
                     f"objective.similarity_pairs={tmp_path / 'bad.csv'}"), tmp_path / "bad")
