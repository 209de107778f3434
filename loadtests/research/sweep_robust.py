"""Sweep the robust-starter recipe: train one configuration (recipe overrides), then evaluate the torch
tower in process at several WiSE-FT alphas (no export per alpha), printing one JSON row per alpha:
AO@10 / JS@10 / distinct images on paraphrase pairs over a gallery, T2I R@1/5/10 on the gallery's
captions, STS-B Spearman. ``loadtests/results/robust_starter.md`` was measured with it.

    python -m paraseek.loadtests.research.sweep_robust NAME [OVERRIDE ...] --data ../shared/data --out runs/sweep

e.g. ``python -m paraseek.loadtests.research.sweep_robust t10 objective.temperature=0.1``. Rows are appended to
``OUT/results.jsonl``; paraphrases and anchor targets are shared between runs through ``OUT``.
"""

from __future__ import annotations

import argparse
import json
import shutil
import time
from pathlib import Path

import numpy as np

from paraseek.core.encoder import Encoder
from paraseek.core.rank_metrics import average_overlap, jaccard_at_k
from paraseek.core.settings import Settings
from paraseek.evaluation.data import read_pairs, read_sts
from paraseek.loadtests import DEFAULT_DATA


def shared_paraphrases(out: Path, spec) -> Path:
    """The rewrites file the sweep's runs share in ``out``: one per way of making them (x', x'' and the
    PPDB file), so a run with x'' from PPDB does not hand its rewrites to a WordNet run."""
    made_by = [spec.x1, spec.x2, *([Path(spec.ppdb).stem] if spec.ppdb else [])]
    return out / f"paraphrases-{'-'.join(made_by)}.jsonl"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("name")
    p.add_argument("overrides", nargs="*")
    p.add_argument("--data", type=Path, default=DEFAULT_DATA)
    p.add_argument("--out", type=Path, default=Path("runs/sweep"))
    p.add_argument("--alphas", type=float, nargs="+", default=[1.0, 0.8, 0.6, 0.4])
    args = p.parse_args(argv)

    from scipy.stats import spearmanr

    from paraseek.training.data import embed_images  # the training stack, lazily: this sweep trains
    from paraseek.training.export.starter import ensure_starter_bundle
    from paraseek.training.losses import wise_ft
    from paraseek.training.recipe import DataSpec, load_recipe
    from paraseek.training.trainer import Trainer

    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    starter = Encoder(ensure_starter_bundle(Settings().plain_starter_bundle_dir))
    gallery = embed_images(DataSpec(captions=str(args.data / "coco-mini/captions_val2017.json")), starter, out / "gallery")
    images = gallery.vectors.astype(np.float32)
    pairs = read_pairs(args.data / "paraphrase/cxc_dev_pairs.tsv")
    captions = [(i, c) for i, group in enumerate(gallery.captions) for c in group]
    sts = read_sts(args.data / "sts/sts-dev.csv")

    def embed(tower, texts: list[str]) -> np.ndarray:
        tower.eval()
        return tower.embed(texts, 128)

    def evaluate(tower) -> dict:
        a, b = embed(tower, [x for x, _ in pairs]), embed(tower, [y for _, y in pairs])
        top_a, top_b = np.argsort(-a @ images.T, 1)[:, :10], np.argsort(-b @ images.T, 1)[:, :10]
        ranks = np.argsort(-embed(tower, [c for _, c in captions]) @ images.T, 1)
        position = np.array([np.where(row == owner)[0][0] for row, (owner, _) in zip(ranks, captions)])
        s1, s2 = embed(tower, [q.a for q in sts]), embed(tower, [q.b for q in sts])
        return {"AO@10": round(float(np.mean([average_overlap(list(x), list(y), 10) for x, y in zip(top_a, top_b)])), 4),
                "JS@10": round(float(np.mean([jaccard_at_k(list(x), list(y), 10) for x, y in zip(top_a, top_b)])), 4),
                "distinct": len(set(top_a.ravel()) | set(top_b.ravel())),
                **{f"R@{k}": round(100 * float(np.mean(position < k)), 1) for k in (1, 5, 10)},
                "STS": round(float(spearmanr((s1 * s2).sum(1), [q.score for q in sts]).correlation), 4)}

    shared_rewrites = shared_paraphrases(out, load_recipe("robust-starter", args.overrides).data.paraphrases)
    recipe = load_recipe("robust-starter", [*args.overrides, f"data.paraphrases.dataset={shared_rewrites}"])
    run_dir = out / args.name
    run_dir.mkdir(exist_ok=True)
    for shared in out.glob("anchor-targets-*.npz"):  # the same texts and targets for every run
        shutil.copy(shared, run_dir)
    start = time.perf_counter()
    trainer = Trainer(recipe, run_dir)
    for made in run_dir.glob("anchor-targets-*.npz"):
        shutil.copy(made, out)
    losses = trainer.fit(progress=False)
    seconds = round(time.perf_counter() - start)
    tuned = {k: v.clone() for k, v in trainer.tower.trainable_state().items()}
    original = trainer.original.state_dict() if trainer.original is not None else tuned
    for alpha in args.alphas:
        trainer.tower.load_state_dict(wise_ft(original, tuned, alpha), strict=False)
        row = {"name": args.name, "alpha": alpha, **evaluate(trainer.tower), "train_s": seconds,
               "loss": [round(losses[0], 3), round(losses[-1], 3)] if losses else None, "overrides": args.overrides}
        print(json.dumps(row), flush=True)
        with open(out / "results.jsonl", "a") as f:
            f.write(json.dumps(row) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
