"""The evaluation suite over one bundle + snapshot, and the comparison of several bundles."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np
from tqdm import tqdm

from paraseek.core.encoder import Encoder
from paraseek.core.errors import UserError
from paraseek.core.rank_metrics import average_overlap
from paraseek.evaluation.expansion import parse_expansion
from paraseek.evaluation.paraphrase import evaluate_pairs
from paraseek.evaluation.perturb import perturb_all, perturbations
from paraseek.evaluation.retrieval import cross_modal_recall
from paraseek.evaluation.sts import evaluate_sts
from paraseek.index.builder import build_snapshot
from paraseek.index.snapshot import Snapshot
from paraseek.paraphrase.expansions import ConfidentLead, HubCorrection, KeepFirst


class NoCaptionsError(UserError):
    """The snapshot stores no captions, so caption-based retrieval cannot be measured on it."""


def snapshot_captions(snapshot) -> tuple[list[str], list[int]]:
    """Captions stored with a snapshot's images (COCO sources) and the image id of each."""
    texts, ids = [], []
    for image_id in snapshot.ids:
        for c in snapshot.metadata[int(image_id)].get("captions", []):
            texts.append(c)
            ids.append(int(image_id))
    if not texts:
        raise NoCaptionsError(f"snapshot {snapshot.version} has no captions: build it from a COCO captions file")
    return texts, ids


def retrieval_on_snapshot(encoder: Encoder, snapshot, expand=None, keep: KeepFirst = KeepFirst(),
                          lead: ConfidentLead = ConfidentLead(), lead_encoder: Encoder | None = None,
                          hub: HubCorrection = HubCorrection(), image_bias: np.ndarray | None = None) -> dict[str, float]:
    """Retrieval with the snapshot's own captions as queries (expanded by ``expand`` when given, the
    unexpanded query's first results leading as ``keep`` says, ``lead_encoder``'s where ``lead`` says, the
    scores hub-corrected as ``hub`` says)."""
    texts, ids = snapshot_captions(snapshot)
    plain = encoder.encode_text(texts)
    queries = expand(texts, plain) if expand is not None else plain
    lead_vecs = lead_encoder.encode_text(texts) if lead and lead_encoder is not None else None
    return cross_modal_recall(np.asarray(snapshot.vectors()), snapshot.ids, queries, ids,
                              plain_text_vecs=plain, keep=keep, lead_text_vecs=lead_vecs, lead=lead, hub=hub,
                              image_bias=image_bias)


def perturbation_suite(encoder: Encoder, snapshot, wordnet_source=None, seed: int = 0, k: int = 10,
                       progress: bool = True, sample: int | None = None) -> dict[str, dict[str, float]]:
    """Text-to-image R@1/5/10 on clean and perturbed captions, the relative drop, and AO@k between each
    caption's clean and perturbed top-k lists. ``sample``: that many captions drawn at random (seeded by
    ``seed``) instead of all of them; the gallery stays whole."""

    texts, ids = snapshot_captions(snapshot)
    if sample is not None and sample < len(texts):
        keep = np.sort(np.random.default_rng(seed).choice(len(texts), sample, replace=False))
        texts, ids = [texts[i] for i in keep], [ids[i] for i in keep]
    vectors = np.asarray(snapshot.vectors())

    def t2i(query_vecs):
        r = cross_modal_recall(vectors, snapshot.ids, query_vecs, ids)
        return {key: r[key] for key in ("t2i_r1", "t2i_r5", "t2i_r10")}

    clean_vecs = encoder.encode_text(texts)
    clean = t2i(clean_vecs)
    _, clean_lists = snapshot.search_ids(clean_vecs, k)
    out = {"clean": {**clean, "captions": len(texts)}}
    for name, fn in tqdm(perturbations(wordnet_source).items(), desc="perturbations", disable=not progress):
        vecs = encoder.encode_text(perturb_all(texts, fn, seed))
        res = t2i(vecs)
        _, lists = snapshot.search_ids(vecs, k)
        res[f"ao@{k}_vs_clean"] = float(np.mean([average_overlap(list(a), list(b), k) for a, b in zip(clean_lists, lists)]))
        res["relative_drop_r1"] = (clean["t2i_r1"] - res["t2i_r1"]) / clean["t2i_r1"] if clean["t2i_r1"] else 0.0
        out[name] = res
    return out


@dataclass
class Model:
    name: str
    bundle: Path
    snapshot: Path | None = None


def parse_model(spec: str) -> Model:
    """NAME=BUNDLE or NAME=BUNDLE@SNAPSHOT"""
    if "=" not in spec:
        raise UserError(f"model {spec!r}: expected NAME=BUNDLE[@SNAPSHOT]")
    name, rest = spec.split("=", 1)
    bundle, _, snapshot = rest.partition("@")
    return Model(name, Path(bundle), Path(snapshot) if snapshot else None)


def compare(models: Sequence[Model], out: Path, *, pairs=None, sts=None, images=None, image_root=None,
            k: int = 10, progress: bool = True, expansions: Sequence[str] = (), settings=None, ppdb=None,
            bank=None, expand_models: Sequence[str] = (), first_answer: Path | None = None) -> list[dict]:
    """One row of metrics per model and expansion (plain first); writes results.json, results.md and
    PNG plots into ``out``. ``expand_models``: the models the expansions apply to (default: all), so
    ablation rows can sit in the same table without every expansion. ``first_answer``: the bundle whose
    first answers an expansion's ``:leadM`` puts on top."""
    unknown = set(expand_models) - {m.name for m in models}
    if unknown:
        raise UserError(f"--expand {', '.join(sorted(unknown))}: no model of that name")

    out.mkdir(parents=True, exist_ok=True)
    lead_encoder = Encoder(first_answer, load_image=False) if first_answer is not None else None
    rows, ao_distributions = [], {}
    for m in tqdm(models, desc="models", disable=not progress):
        enc = Encoder(m.bundle)
        snap_path = m.snapshot
        if snap_path is None:
            if images is None:
                raise UserError(f"model {m.name}: give NAME=BUNDLE@SNAPSHOT or --images to index with it")
            snap_path = out / "snapshots" / m.name
            build_snapshot(images, enc, snap_path, image_root=image_root, progress=progress)
        snap = Snapshot.load(snap_path, image_space=enc.image_space)
        sts_row = evaluate_sts(enc, sts) if sts else None
        for spec in (None, *(expansions if not expand_models or m.name in expand_models else ())):
            exp = parse_expansion(spec, enc, snap, settings, ppdb, bank, lead_encoder) if spec else None
            name = m.name if exp is None else f"{m.name} + {exp.label}"
            row: dict = {"model": name, "bundle": f"{enc.name} v{enc.version}", "images": len(snap)}
            if pairs:
                res = evaluate_pairs(enc, snap, pairs, k=k, progress=progress, expand=exp.expand if exp else None,
                                     keep=exp.keep if exp else KeepFirst(), lead=exp.lead if exp else ConfidentLead(),
                                     lead_encoder=exp.lead_encoder if exp else None,
                                     hub=exp.hub if exp else HubCorrection(), image_bias=exp.image_bias if exp else None)
                row[f"AO@{k}"], row[f"JS@{k}"] = float(res.ao.mean()), float(res.js.mean())
                row[f"distinct images in top-{k}"] = res.summary()["distinct_images"]
                ao_distributions[name] = res.ao
            try:
                r = (retrieval_on_snapshot(enc, snap, exp.expand, exp.keep, exp.lead, exp.lead_encoder, exp.hub,
                                           exp.image_bias) if exp
                     else retrieval_on_snapshot(enc, snap))
                row.update({"T2I R@1": r["t2i_r1"], "T2I R@5": r["t2i_r5"], "T2I R@10": r["t2i_r10"]})
                if exp is None:  # image-to-text and RSUM do not depend on query expansion
                    row.update({"I2T R@1": r["i2t_r1"], "I2T R@5": r["i2t_r5"], "I2T R@10": r["i2t_r10"], "RSUM": r["rsum"]})
            except NoCaptionsError:
                pass  # a snapshot without captions: no retrieval columns
            if sts_row:
                row["STS Spearman"], row["STS Pearson"] = sts_row["spearman"], sts_row["pearson"]
            rows.append(row)
    (out / "results.json").write_text(json.dumps(rows, indent=2))
    (out / "results.md").write_text(markdown_table(rows))
    plot_results(rows, ao_distributions, out, k)
    return rows


def markdown_table(rows: list[dict]) -> str:
    cols = list(dict.fromkeys(c for r in rows for c in r))
    fmt = lambda v: f"{v:.3f}" if isinstance(v, float) and abs(v) <= 1 else (f"{v:.1f}" if isinstance(v, float) else str(v))  # noqa: E731
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(fmt(r.get(c, "")) for c in cols) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def plot_results(rows, ao_distributions, out: Path, k: int) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    if ao_distributions:
        fig, ax = plt.subplots(figsize=(7, 4))
        bins = np.linspace(0, 1, 21).tolist()
        for name, ao in ao_distributions.items():
            ax.hist(ao, bins=bins, alpha=0.5, label=f"{name} (mean {ao.mean():.3f})")
        ax.set_xlabel(f"AO@{k} between a query's and its paraphrase's top-{k}")
        ax.set_ylabel("pairs")
        written.append(_save(fig, ax, "Paraphrase consistency", out / "ao_distribution.png"))
    keys = [c for c in ("T2I R@1", "T2I R@5", "T2I R@10", "I2T R@1", "I2T R@5", "I2T R@10") if any(c in r for r in rows)]
    if keys:
        fig, ax = plt.subplots(figsize=(8, 4))
        width = 0.8 / len(rows)
        x = np.arange(len(keys))
        for j, r in enumerate(rows):
            ax.bar(x + j * width, [r.get(c, 0) for c in keys], width, label=r["model"])
        ax.set_xticks(x + width * (len(rows) - 1) / 2, keys)
        ax.set_ylabel("recall (%)")
        written.append(_save(fig, ax, "Retrieval", out / "recall.png"))
    return written


def _save(fig, ax, title: str, path: Path) -> Path:
    import matplotlib.pyplot as plt

    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
