"""``paraseek eval ...``: paraphrase consistency, retrieval, STS and perturbation suites (no torch)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import List, Optional

import numpy as np
import typer
from rich.table import Table

from paraseek.core.cli_support import console, err, user_errors
from paraseek.core.encoder import Encoder
from paraseek.core.errors import UserError
from paraseek.core.settings import Settings
from paraseek.evaluation.data import read_pairs, read_sts
from paraseek.evaluation.expansion import parse_expansion, spec_help
from paraseek.evaluation.paraphrase import evaluate_pairs, write_pairs_csv
from paraseek.evaluation.retrieval import cross_modal_recall
from paraseek.evaluation.sts import evaluate_sts
from paraseek.evaluation.suite import compare, parse_model, perturbation_suite, retrieval_on_snapshot
from paraseek.index.cli import load_encoder, load_snapshot
from paraseek.index.snapshot import Snapshot
from paraseek.paraphrase import ParaphraseSourceUnavailable
from paraseek.paraphrase.factory import make_source

app = typer.Typer(help="Evaluate bundles: paraphrase consistency, retrieval, STS, perturbations.", no_args_is_help=True)

FIRST_ANSWER_HELP = ("Bundle of the same image space whose first answer an expansion's `:leadM` suffix puts on top where "
                     "that tower's first score exceeds its second by more than M (the service's "
                     "PARASEEK_FIRST_ANSWER_BUNDLE and `lead_margin`).")


def _load_pair(bundle: Path | None, snapshot: Path | None) -> tuple[Encoder, Snapshot]:
    enc = load_encoder(bundle)
    return enc, load_snapshot(snapshot, enc)


@app.command("paraphrase")
@user_errors
def paraphrase_cmd(
    pairs: Path = typer.Option(..., help="TSV of (query, paraphrase) pairs, e.g. CxC caption1/caption2."),
    snapshot: Optional[Path] = typer.Option(None, help="Snapshot root (default: the demo)."),
    bundle: Optional[Path] = typer.Option(None),
    k: int = typer.Option(10, "--k", "-k", min=1, max=1000),
    expansion: List[str] = typer.Option([], help="Also evaluate with query expansion (repeatable), any registered method: "
                                        + spec_help() + "."),
    ppdb: Optional[Path] = typer.Option(None, help="PPDB TSV for ppdb expansion (default: PARASEEK_PPDB_PATH)."),
    bank: Optional[Path] = typer.Option(None, help="Caption bank folder (default: the bundle's bank under $PARASEEK_HOME)."),
    first_answer_bundle: Optional[Path] = typer.Option(None, help=FIRST_ANSWER_HELP),
    out: Optional[Path] = typer.Option(None, help="Folder for per-pair CSV and summary JSON."),
):
    """AO@k and JS@k between the top-k lists of each query and its paraphrase."""
    text_pairs = read_pairs(pairs)
    enc, snap = _load_pair(bundle, snapshot)
    lead_encoder = Encoder(first_answer_bundle, load_image=False) if first_answer_bundle is not None else None
    results = [evaluate_pairs(enc, snap, text_pairs, k=k)]
    for spec in expansion:
        exp = parse_expansion(spec, enc, snap, Settings(), ppdb, bank, lead_encoder)
        results.append(evaluate_pairs(enc, snap, text_pairs, k=k, expand=exp.expand, label=exp.label,
                                      keep=exp.keep, lead=exp.lead, lead_encoder=exp.lead_encoder))
    summary = {r.label: r.summary() for r in results}
    if out:
        write_pairs_csv(out / "pairs.csv", text_pairs, results)
        (out / "summary.json").write_text(json.dumps(summary, indent=2))
    console.print_json(json.dumps(summary))


@app.command("retrieval")
@user_errors
def retrieval_cmd(
    snapshot: Optional[Path] = typer.Option(None, help="Snapshot built from a COCO captions file (default: the demo)."),
    bundle: Optional[Path] = typer.Option(None),
    features: Optional[Path] = typer.Option(None, help="Precomputed (2, N, D) .npy: [0] images, [1] their captions."),
):
    """Text-to-image and image-to-text R@1/5/10 and RSUM."""
    if features is not None:
        arr = np.load(features)
        if arr.ndim != 3 or arr.shape[0] != 2:
            raise UserError(f"{features}: expected shape (2, N, D), got {arr.shape}")
        ids = list(range(arr.shape[1]))
        result = cross_modal_recall(arr[0], ids, arr[1], ids)
    else:
        result = retrieval_on_snapshot(*_load_pair(bundle, snapshot))
    console.print_json(json.dumps(result))


@app.command("sts")
@user_errors
def sts_cmd(
    file: Path = typer.Option(..., help="STS-B format: genre, file, year, id, score, sentence1, sentence2."),
    bundle: Optional[Path] = typer.Option(None),
):
    """Spearman and Pearson of cosine similarity against gold scores."""
    pairs = read_sts(file)  # check the data before loading the model
    console.print_json(json.dumps(evaluate_sts(load_encoder(bundle), pairs)))


@app.command("perturb")
@user_errors
def perturb_cmd(
    snapshot: Optional[Path] = typer.Option(None, help="Snapshot with captions (default: the demo)."),
    bundle: Optional[Path] = typer.Option(None),
    seed: int = typer.Option(0),
    sample: Optional[int] = typer.Option(None, min=1, help="Only this many of the snapshot's captions, drawn at random "
                                         "(seeded by --seed): a quicker, noisier report. Default: all."),
    out: Optional[Path] = typer.Option(None, help="Write the report as JSON here."),
):
    """Retrieval on clean vs perturbed captions (character and word level), with relative drops."""
    try:
        wordnet = make_source("wordnet", Settings(), usual_only=False)  # a stress test: every synonym
    except ParaphraseSourceUnavailable as exc:
        err.print(f"synonym perturbation skipped: {exc}")
        wordnet = None
    report = perturbation_suite(*_load_pair(bundle, snapshot), wordnet_source=wordnet, seed=seed, sample=sample)
    table = Table(title=f"perturbation robustness (text-to-image, {report['clean']['captions']} captions)")
    for col in ("perturbation", "R@1", "R@5", "R@10", "drop R@1", "AO@10 vs clean"):
        table.add_column(col)
    for name, r in report.items():
        table.add_row(name, f"{r['t2i_r1']:.1f}", f"{r['t2i_r5']:.1f}", f"{r['t2i_r10']:.1f}",
                      f"{r.get('relative_drop_r1', 0):.1%}", f"{r.get('ao@10_vs_clean', 1):.3f}")
    console.print(table)
    if out:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(report, indent=2))


@app.command("compare")
@user_errors
def compare_cmd(
    model: List[str] = typer.Option(..., help="NAME=BUNDLE or NAME=BUNDLE@SNAPSHOT (repeatable)."),
    out: Path = typer.Option(Path("eval-report"), help="Folder for results.md/json and plots."),
    pairs: Optional[Path] = typer.Option(None, help="Paraphrase pairs TSV."),
    sts: Optional[Path] = typer.Option(None, help="STS-B file."),
    images: Optional[Path] = typer.Option(None, help="COCO captions JSON to index models given without a snapshot."),
    image_root: Optional[Path] = typer.Option(None, help="Image folder of --images."),
    k: int = typer.Option(10, "--k", "-k", min=1, max=1000),
    expansion: List[str] = typer.Option([], help="Also evaluate each model with these expansions (repeatable, as in "
                                        "`eval paraphrase`)."),
    ppdb: Optional[Path] = typer.Option(None, help="PPDB TSV for ppdb expansion (default: PARASEEK_PPDB_PATH)."),
    bank: Optional[Path] = typer.Option(None, help="Caption bank folder (default: each bundle's bank under $PARASEEK_HOME)."),
    expand: List[str] = typer.Option([], help="Apply --expansion to this model only (repeatable; default: every model)."),
    first_answer_bundle: Optional[Path] = typer.Option(None, help=FIRST_ANSWER_HELP),
):
    """The suite over several bundles and expansions: a Markdown/JSON table (rows = model + expansion) plus PNG plots."""
    rows = compare([parse_model(m) for m in model], out, pairs=read_pairs(pairs) if pairs else None,
                   sts=read_sts(sts) if sts else None, images=images, image_root=image_root, k=k,
                   expansions=expansion, settings=Settings(), ppdb=ppdb, bank=bank, expand_models=expand,
                   first_answer=first_answer_bundle)
    console.print((out / "results.md").read_text())
    console.print(f"written to {out} ({len(rows)} models)")
