"""Evaluation harness: real CLIP embeddings, STS on the starter, perturbations, compare."""

import json
import random

import numpy as np
import pytest
from typer.testing import CliRunner

from paraseek.cli import app
from paraseek.core.errors import UserError
from paraseek.evaluation import perturb
from paraseek.evaluation.data import DataError, held_out_texts, read_pairs, read_sts, without_held_out
from paraseek.evaluation.retrieval import cross_modal_recall
from paraseek.paraphrase.expansions import ConfidentLead, HubCorrection, KeepFirst


@pytest.mark.quick
def test_reproduces_real_clip_recall(shared_data):
    """OpenAI CLIP ViT-B/16 on 500 COCO val images: published R@1 50.6, R@5 76.4, R@10 86.2."""
    feats = np.load(shared_data / "clip-vitb16-coco500/features_clip.npy")
    ids = list(range(feats.shape[1]))
    r = cross_modal_recall(feats[0], ids, feats[1], ids)
    assert (round(r["t2i_r1"], 1), round(r["t2i_r5"], 1), round(r["t2i_r10"], 1)) == (50.6, 76.4, 86.2)
    rand = np.load(shared_data / "clip-vitb16-coco500/features_clip_random.npy")
    r0 = cross_modal_recall(rand[0], ids, rand[1], ids)
    assert r0["t2i_r10"] < 5  # chance is 2.0 for 500 images


@pytest.mark.quick
def test_recall_with_several_captions_per_image():
    images = np.eye(3, dtype=np.float32)
    texts = np.array([[1, 0, 0], [0.9, 0.1, 0], [0, 0, 1], [0, 1, 0.1]], np.float32)
    r = cross_modal_recall(images, [10, 20, 30], texts, [10, 10, 20, 20], ks=(1,))
    assert r["t2i_r1"] == pytest.approx(75.0)  # captions 1, 2, 4 find their image; caption 3 finds image 30
    assert r["i2t_r1"] == pytest.approx(100.0)  # images 10 and 20 each find one of their captions
    with pytest.raises(ValueError, match="not in the gallery"):
        cross_modal_recall(images, [10, 20, 30], texts, [10, 10, 20, 99])


@pytest.mark.quick
def test_recall_with_keep_first_ranks_as_the_served_list():
    """Caption 0's expanded vector ranks image 30 first, its plain one its own image 10: keep_first 1
    serves 10 first; caption 1's lists both lead with 20. Below the kept result the expanded order holds."""
    images = np.eye(3, dtype=np.float32)
    plain = np.array([[1, 0, 0.5], [0, 1, 0.5]], np.float32)
    expanded = np.array([[0.2, 0, 1], [0.1, 1, 0.5]], np.float32)
    assert cross_modal_recall(images, [10, 20, 30], expanded, [10, 20], ks=(1,))["t2i_r1"] == pytest.approx(50.0)
    kept = cross_modal_recall(images, [10, 20, 30], expanded, [10, 20], ks=(1,), plain_text_vecs=plain, keep=KeepFirst(1))
    assert kept["t2i_r1"] == pytest.approx(100.0)
    assert kept["i2t_r1"] == cross_modal_recall(images, [10, 20, 30], expanded, [10, 20], ks=(1,))["i2t_r1"]
    # keep_blend: caption 0's query moved 0.2 of the way to its expanded vector still ranks 10 first, half way 30
    for blend, r1 in ((0.2, 100.0), (0.5, 50.0)):
        moved = cross_modal_recall(images, [10, 20, 30], expanded, [10, 20], ks=(1,), plain_text_vecs=plain,
                                   keep=KeepFirst(1, blend=blend))
        assert moved["t2i_r1"] == pytest.approx(r1), blend


@pytest.mark.quick
def test_recall_with_hub_correction_ranks_by_the_corrected_scores():
    """Image 30 is a hub (bias 0.9): caption 0 ranks it first by cosine (0.6 against its own image's 0.5),
    and second once each score loses half its image's bias; image-to-text recall is untouched."""
    images = np.eye(3, dtype=np.float32)
    texts = np.array([[0.5, 0, 0.6], [0, 1, 0.2]], np.float32)
    bias = np.array([0.1, 0.1, 0.9], np.float32)
    assert cross_modal_recall(images, [10, 20, 30], texts, [10, 20], ks=(1,))["t2i_r1"] == pytest.approx(50.0)
    hubbed = cross_modal_recall(images, [10, 20, 30], texts, [10, 20], ks=(1,), hub=HubCorrection(0.5), image_bias=bias)
    assert hubbed["t2i_r1"] == pytest.approx(100.0)
    assert hubbed["i2t_r1"] == cross_modal_recall(images, [10, 20, 30], texts, [10, 20], ks=(1,))["i2t_r1"]
    assert cross_modal_recall(images, [10, 20, 30], texts, [10, 20], ks=(1,), hub=HubCorrection(0.1),
                              image_bias=bias)["t2i_r1"] == pytest.approx(50.0)  # 0.6 - 0.09 still beats 0.5 - 0.01


@pytest.mark.quick
def test_recall_with_a_confident_lead_ranks_as_the_served_list():
    """Caption 0's list leads with image 30; the lead tower is sure of image 10 (margin 0.8), so 10 leads.
    Caption 1's lead tower prefers 10 by only 0.05: below the margin, its list stays as it was."""
    images = np.eye(3, dtype=np.float32)
    expanded = np.array([[0.2, 0, 1], [0.1, 1, 0.5]], np.float32)
    lead_vecs = np.array([[1, 0, 0.2], [0.5, 0.45, 0]], np.float32)
    led = cross_modal_recall(images, [10, 20, 30], expanded, [10, 20], ks=(1, 2), lead_text_vecs=lead_vecs,
                             lead=ConfidentLead(0.1))
    assert (led["t2i_r1"], led["t2i_r2"]) == pytest.approx((100.0, 100.0))
    everywhere = cross_modal_recall(images, [10, 20, 30], expanded, [10, 20], ks=(1,), lead_text_vecs=lead_vecs,
                                    lead=ConfidentLead(0.01))
    assert everywhere["t2i_r1"] == pytest.approx(50.0)  # now caption 1's lead (image 10, not its own) leads too
    assert cross_modal_recall(images, [10, 20, 30], expanded, [10, 20], ks=(1,), lead_text_vecs=lead_vecs)["t2i_r1"] == \
        pytest.approx(50.0)  # no margin: no lead


def test_sts_of_starter_text_tower(starter_encoder, shared_data):
    from paraseek.evaluation.sts import evaluate_sts

    r = evaluate_sts(starter_encoder, read_sts(shared_data / "sts/sts-dev.csv"))
    assert r["pairs"] == 1500
    assert 0.8 <= r["spearman"] <= 0.92, r  # all-MiniLM-L6-v2 on STS-B dev: ~0.87


@pytest.mark.quick
def test_readers(shared_data, tmp_path):
    pairs = read_pairs(shared_data / "paraphrase/cxc_dev_pairs.tsv")
    assert len(pairs) == 445 and pairs[0] == ("a bath room sink with large mirror", "An image of a bathroom with a sink and mirror")
    (tmp_path / "p.tsv").write_text("id\tq\tp\n1\ta dog\ta puppy\n")
    assert read_pairs(tmp_path / "p.tsv") == [("a dog", "a puppy")]
    (tmp_path / "empty.tsv").write_text("")
    with pytest.raises(DataError):
        read_pairs(tmp_path / "empty.tsv")
    (tmp_path / "bad.csv").write_text("g\tf\ty\ti\tnot-a-score\ta\tb\ng\tf\ty\ti\tx\ta\tb\n")
    with pytest.raises(DataError, match="not a number"):
        read_sts(tmp_path / "bad.csv")


@pytest.mark.parametrize("name", sorted(perturb.CHARACTER) + sorted(perturb.WORD))
@pytest.mark.quick
def test_perturbations_are_seeded_and_change_text(name):
    fn = perturb.perturbations()[name]
    text = "A man riding a brown horse along the beach at sunset"
    a = fn(text, random.Random(1))
    assert a == fn(text, random.Random(1))
    assert a != text


@pytest.mark.quick
def test_synonym_perturbation_uses_wordnet(shared_data, monkeypatch):
    monkeypatch.setenv("NLTK_DATA", str(shared_data / "nltk_data"))
    from paraseek.core.settings import Settings
    from paraseek.paraphrase.factory import make_source

    fn = perturb.perturbations(make_source("wordnet", Settings(), usual_only=False))["synonym"]
    out = fn("a large dog runs on the grass", random.Random(0))
    assert out != "a large dog runs on the grass" and len(out.split()) >= 6


def test_perturbation_suite_and_paraphrase_cli(starter_bundle, shared_data, tmp_path, monkeypatch):
    """The CLI end to end on a COCO-mini snapshot: perturbations lower recall; paraphrase report files."""
    from paraseek.index.builder import build_snapshot
    from paraseek.core.encoder import Encoder

    monkeypatch.setenv("NLTK_DATA", str(shared_data / "nltk_data"))
    snap = tmp_path / "snap"
    build_snapshot(shared_data / "coco-mini/captions_val2017.json", Encoder(starter_bundle), snap, progress=False)
    runner = CliRunner()
    # 300 of the 795 captions: 11 perturbations encode each caption once more
    r = runner.invoke(app, ["eval", "perturb", "--snapshot", str(snap), "--bundle", str(starter_bundle), "--sample", "300",
                            "--out", str(tmp_path / "perturb.json")])
    assert r.exit_code == 0, r.output
    report = json.loads((tmp_path / "perturb.json").read_text())
    assert report["clean"]["captions"] == 300 and "300 captions" in r.output
    assert report["clean"]["t2i_r10"] >= 65
    assert report["keyboard"]["t2i_r1"] < report["clean"]["t2i_r1"]
    assert 0 < report["keyboard"]["ao@10_vs_clean"] < 1
    pairs = tmp_path / "pairs.tsv"  # 150 of the 445 dev pairs
    pairs.write_text("".join((shared_data / "paraphrase/cxc_dev_pairs.tsv").read_text().splitlines(keepends=True)[:151]))
    r = runner.invoke(app, ["eval", "paraphrase", "--pairs", str(pairs),
                            "--snapshot", str(snap), "--bundle", str(starter_bundle), "--expansion", "wordnet:2",
                            "--out", str(tmp_path / "para")])
    assert r.exit_code == 0, r.output
    summary = json.loads((tmp_path / "para/summary.json").read_text())
    assert 0.3 < summary["plain"]["ao@10"] < 1 and summary["wordnet2"]["pairs"] == 150
    lines = (tmp_path / "para/pairs.csv").read_text().splitlines()
    assert len(lines) == 151 and "plain_ao@10" in lines[0] and "wordnet2_js@10" in lines[0]
    r = runner.invoke(app, ["eval", "retrieval", "--snapshot", str(snap), "--bundle", str(starter_bundle)])
    # the whole-photo image side's R@10 over these 159 photos, as training/export/starter.py records it (77.4)
    assert r.exit_code == 0 and json.loads(r.output)["t2i_r10"] == pytest.approx(77.4, abs=3)


def test_compare_writes_table_and_plots(starter_bundle, tiny_clip, shared_data, tmp_path):
    r = CliRunner().invoke(app, [
        "eval", "compare", "--model", f"starter={starter_bundle}", "--model", f"tiny={tiny_clip[0]}",
        "--images", str(shared_data / "coco-mini/captions_train2017.json"),
        "--pairs", str(shared_data / "paraphrase/cxc_dev_pairs.tsv"), "--out", str(tmp_path / "cmp")])
    assert r.exit_code == 0, r.output
    rows = json.loads((tmp_path / "cmp/results.json").read_text())
    assert [row["model"] for row in rows] == ["starter", "tiny"]
    assert rows[0]["T2I R@10"] > rows[1]["T2I R@10"]  # a real encoder beats random weights
    md = (tmp_path / "cmp/results.md").read_text()
    assert md.startswith("| model |") and "AO@10" in md
    for png in ("ao_distribution.png", "recall.png"):
        assert (tmp_path / "cmp" / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.quick
def test_eval_errors_are_clear(tmp_path):
    r = CliRunner().invoke(app, ["eval", "sts", "--file", str(tmp_path / "missing.csv"), "--bundle", str(tmp_path)])
    assert r.exit_code == 2 and "does not exist" in r.output
    r = CliRunner().invoke(app, ["eval", "compare", "--model", "nonsense"])
    assert r.exit_code == 2 and "NAME=BUNDLE" in r.output


def test_expansions_in_compare_and_the_collapse_guard(starter_bundle, shared_data, tmp_path):
    """compare adds a row per expansion; the distinct-image count equals an independent count over the
    top-10 lists, and an expansion computed by the harness equals its hand computation."""
    from paraseek.core.encoder import Encoder
    from paraseek.evaluation.expansion import parse_expansion
    from paraseek.evaluation.paraphrase import evaluate_pairs
    from paraseek.index.builder import build_snapshot
    from paraseek.index.snapshot import Snapshot
    from paraseek.paraphrase.caption_bank import DEFAULT_TEXTS, CaptionBank, read_caption_texts

    enc = Encoder(starter_bundle)
    bank = CaptionBank.build(enc, read_caption_texts(DEFAULT_TEXTS)[:300], tmp_path / "bank")
    build_snapshot(shared_data / "coco-mini/captions_train2017.json", enc, tmp_path / "snap", progress=False)
    snap = Snapshot.load(tmp_path / "snap")
    pairs = read_pairs(shared_data / "paraphrase/cxc_dev_pairs.tsv")[:60]

    exp = parse_expansion("bank:5", enc, snap, bank=bank.path)
    res = evaluate_pairs(enc, snap, pairs, k=10, expand=exp.expand, progress=False)
    qa = enc.encode_text([a for a, _ in pairs])
    rows = np.argsort(-(qa @ bank.vectors.T), axis=1)[:, :5]
    hand = (qa + bank.vectors[rows].sum(axis=1)) / 6
    _, ia = snap.search_ids(hand / np.linalg.norm(hand, axis=1, keepdims=True), 10)
    assert [a for a, _ in res.lists] == ia.tolist()
    _, ib = snap.search_ids(exp.expand([b for _, b in pairs], enc.encode_text([b for _, b in pairs])), 10)
    assert res.summary()["distinct_images"] == len(set(ia.ravel().tolist()) | set(ib.ravel().tolist()))

    kept = parse_expansion("bank:5:keep1", enc, snap, bank=bank.path)
    assert kept.label == "bank5-mean-keep1" and kept.keep == KeepFirst(1)
    assert parse_expansion("bank:5:keep1in4", enc, snap, bank=bank.path).keep == KeepFirst(1, 4)
    served = evaluate_pairs(enc, snap, pairs, k=10, expand=kept.expand, keep=kept.keep, progress=False)
    _, first = snap.search_ids(qa, 1)
    _, deeper = snap.search_ids(hand / np.linalg.norm(hand, axis=1, keepdims=True), 11)
    assert [a for a, _ in served.lists] == [[f[0]] + [i for i in d if i != f[0]][:9] for f, d in zip(first.tolist(), deeper.tolist())]
    with pytest.raises(UserError, match="keepKinW"):
        parse_expansion("bank:5:keepx", enc, snap, bank=bank.path)
    # @B: the first results kept are those of the query moved the share B of the way to the expanded one
    blended = parse_expansion("bank:5:keep1@0.5", enc, snap, bank=bank.path)
    assert (blended.label, blended.keep) == ("bank5-mean-keep1@0.5", KeepFirst(1, 0, 0.5))
    moved = (qa + hand / np.linalg.norm(hand, axis=1, keepdims=True)) / 2
    _, moved_first = snap.search_ids(moved / np.linalg.norm(moved, axis=1, keepdims=True), 1)
    want_blended = [[f[0]] + [i for i in d if i != f[0]][:9] for f, d in zip(moved_first.tolist(), deeper.tolist())]
    assert [a for a, _ in evaluate_pairs(enc, snap, pairs, k=10, expand=blended.expand, keep=blended.keep,
                                         progress=False).lists] == want_blended
    assert want_blended != [a for a, _ in served.lists]  # these pairs tell the blend from the plain query's answer
    for bad in ("bank:5:keep1@1", "bank:5:keep1@x", "bank:5:keep1@"):
        with pytest.raises(UserError, match="keepKinW"):
            parse_expansion(bad, enc, snap, bank=bank.path)

    # :leadM with the same tower as the first-answer one: margin 0 is keep_first 1 (no ties here), 2 never leads
    led = parse_expansion("bank:5:keep1in4:lead0.03", enc, snap, bank=bank.path, first_answer=enc)
    assert (led.label, led.keep, led.lead) == ("bank5-mean-keep1in4-lead0.03", KeepFirst(1, 4), ConfidentLead(0.03))
    always, never = (parse_expansion(f"bank:5:lead{m}", enc, snap, bank=bank.path, first_answer=enc) for m in (0, 2))
    assert evaluate_pairs(enc, snap, pairs, k=10, expand=always.expand, lead=always.lead, lead_encoder=enc,
                          progress=False).lists == served.lists
    assert evaluate_pairs(enc, snap, pairs, k=10, expand=never.expand, lead=never.lead, lead_encoder=enc,
                          progress=False).lists == res.lists
    # :hubW: every list the served tower searches is its first 100 reordered by score less W x the image's hubness
    hubbed = parse_expansion("bank:5:keep1in4:hub0.5", enc, snap, bank=bank.path)
    assert (hubbed.label, hubbed.keep, hubbed.hub) == ("bank5-mean-keep1in4-hub0.5", KeepFirst(1, 4), HubCorrection(0.5))
    bias = bank.hub_bias(np.asarray(snap.vectors()))
    np.testing.assert_allclose(hubbed.image_bias, bias)
    position = {int(i): r for r, i in enumerate(snap.ids)}

    def corrected(vectors, k):
        scores, ids = snap.search_ids(vectors, 100)
        shifted = scores - 0.5 * np.array([[bias[position[int(i)]] for i in row] for row in ids])
        return [[int(row[j]) for j in np.argsort(-s, kind="stable")[:k]] for row, s in zip(ids, shifted)]

    hub_served = evaluate_pairs(enc, snap, pairs, k=10, expand=hubbed.expand, keep=hubbed.keep, hub=hubbed.hub,
                                image_bias=hubbed.image_bias, progress=False)
    first, deeper = corrected(qa, 1), corrected(hand / np.linalg.norm(hand, axis=1, keepdims=True), 14)
    want = [KeepFirst(1, 4).serve(f, d)[:10] for f, d in zip(first, deeper)]
    assert [a for a, _ in hub_served.lists] == want and want != [a for a, _ in served.lists]
    alone = parse_expansion("none:hub0.5", enc, snap, bank=bank.path)  # the correction without an expansion
    assert alone.label == "none-hub0.5"
    assert [a for a, _ in evaluate_pairs(enc, snap, pairs, k=10, expand=alone.expand, hub=alone.hub,
                                         image_bias=alone.image_bias, progress=False).lists] == corrected(qa, 10)
    for bad in ("bank:5:hub0", "bank:5:hub3", "bank:5:hubx", "none", "none:3:hub0.5", "none:keep1:hub0.5"):
        with pytest.raises(UserError, match="hubW"):
            parse_expansion(bad, enc, snap, bank=bank.path)
    for bad, message in (("bank:5:lead0.1", "first-answer-bundle"), ("bank:5:leadx", "leadM"), ("bank:5:lead3", "leadM")):
        with pytest.raises(UserError, match=message):
            parse_expansion(bad, enc, snap, bank=bank.path)

    # a hundred of the 445 pairs: the rows, not the numbers, are checked here (20 s -> 5 s)
    some_pairs = tmp_path / "pairs.tsv"
    some_pairs.write_text("".join((shared_data / "paraphrase/cxc_dev_pairs.tsv").read_text().splitlines(keepends=True)[:101]))
    r = CliRunner().invoke(app, [
        "eval", "compare", "--model", f"starter={starter_bundle}@{tmp_path / 'snap'}", "--pairs",
        str(some_pairs), "--expansion", "bank:5", "--expansion", "prf:3",
        "--bank", str(bank.path), "--out", str(tmp_path / "cmp"), "--expansion", "bank:5:keep1:lead0",
        "--first-answer-bundle", str(starter_bundle)])
    assert r.exit_code == 0, r.output
    table = json.loads((tmp_path / "cmp/results.json").read_text())
    assert [row["model"] for row in table] == ["starter", "starter + bank5-mean", "starter + prf3-a1-b1",
                                               "starter + bank5-mean-keep1-lead0"]
    assert all(0 < row["distinct images in top-10"] <= 80 and "T2I R@10" in row for row in table)
    r = CliRunner().invoke(app, ["eval", "paraphrase", "--pairs", str(shared_data / "paraphrase/cxc_dev_pairs.tsv"),
                                 "--snapshot", str(tmp_path / "snap"), "--bundle", str(starter_bundle),
                                 "--expansion", "bank:x"])
    assert r.exit_code == 2 and "not a number" in r.output


@pytest.mark.quick
def test_held_out_texts_are_matched_whatever_their_case_and_spaces(tmp_path):
    (tmp_path / "pairs.tsv").write_text("caption1\tcaption2\n A Dog on a sofa\ta puppy\n")
    held = held_out_texts([tmp_path / "pairs.tsv"])
    assert held == {"a dog on a sofa", "a puppy"}
    assert without_held_out(["a dog on a sofa ", "A PUPPY", "a bus", "a puppy on a couch"], held) == ["a bus", "a puppy on a couch"]


def test_a_first_answer_tower_of_another_image_space_is_refused(starter_encoder, tiny_clip):
    from paraseek.core.encoder import Encoder
    from paraseek.evaluation.expansion import parse_expansion

    with pytest.raises(UserError, match="image space"):
        parse_expansion("bank:5:lead0.03", starter_encoder, None, first_answer=Encoder(tiny_clip[0]))
