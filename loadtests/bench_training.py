"""What a training run needs, measured before it is started: a recipe's step on this machine's device.

For each ``--batch-sizes`` (and ``--encode-chunks``, ``--token-cache``): the recipe's training step (every term it has, forward
and backward, AdamW, bf16 autocast on a GPU as the recipe says) run ``--steps`` times after ``--warmup`` steps. Reported: the
median seconds a step, the texts the step encodes a second, the CPU seconds of tokenising a step's photo
and text-set captions (x, x′, x″; part of the step), the peak memory (the accelerator's, or the
process' resident set on a CPU), and what a run of ``--photos`` photos for the recipe's epochs would take
at that step time. Before the steps, the one-off costs of the run: exporting the frozen tower's bundle,
embedding the caption bank, and the run's setup (ParaCLIP's x″ for every caption, the anchor targets).

The image term's vectors are computed once by the frozen image tower in a real run (`paraseek models
embed-images`); here they are seeded random unit vectors in that tower's image space, one per photo of
``--captions`` (the shipped COCO caption sets unless given; a step's cost does not depend on what they hold). The captions, their rewrites, the bank
and the towers are what the recipe uses. Without ``--pretrained`` the tower is random-initialised (its
cost is the architecture's).

    python -m paraseek.loadtests.bench_training [--recipe robust-openclip] [--model ViT-B-32]
        [--pretrained TAG|FILE] [--batch-sizes 256 1024] [--steps 10] [--captions TSV] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

import numpy as np

from paraseek.core.errors import UserError
from paraseek.evaluation.data import read_caption_groups
from paraseek.loadtests import temporary_folder
from paraseek.loadtests.machine import cpu_description, gpu_description

COCO_TRAIN_PHOTOS = 118_287  # COCO train2017


def photo_embeddings(groups: list[list[str]], dim: int, image_space: str, out: Path, seed: int = 0) -> Path:
    """A ``data.image_embeddings`` file with one seeded random unit vector per caption group."""
    from paraseek.training.data import ImageEmbeddings, save_image_embeddings

    vectors = np.random.default_rng(seed).standard_normal((len(groups), dim)).astype(np.float32)
    vectors /= np.linalg.norm(vectors, axis=1, keepdims=True)
    save_image_embeddings(out, ImageEmbeddings(np.arange(len(groups)), vectors, groups), image_space)
    return out


def texts_per_step(photos: int, text_sets: int, preserved: int, batch_size: int, text_per_batch: int) -> int:
    """Texts one step encodes with gradients: x, x′ and x″ of each photo and text set, and the held sentences."""
    return 3 * (min(batch_size, photos) + min(text_per_batch, text_sets)) + preserved


def _seconds(fn, *args) -> float:
    started = time.perf_counter()
    fn(*args)
    return time.perf_counter() - started


def peak_memory_gib(device) -> float:
    import torch

    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux: the process' peak


def bench(args: argparse.Namespace, after_row: Callable[[dict], None] = lambda result: None) -> dict:
    """The measurements; ``after_row`` gets the result so far after each row (a long run's partial record)."""
    import torch

    import paraseek.training.torch_env  # noqa: F401  (torchvision shim before torch-side imports)
    from paraseek.core.encoder import Encoder
    from paraseek.paraphrase.caption_bank import DEFAULT_TEXTS, CaptionBank, read_caption_texts
    from paraseek.training.data import sample_batch
    from paraseek.training.models import CachedClipTokenizer
    from paraseek.training.recipe import load_recipe
    from paraseek.training.trainer import Trainer, build_model, run_steps, seed_everything

    work = Path(args.work) if args.work else temporary_folder("paraseek-bench-training-")
    run_dir = work / "run"
    run_dir.mkdir(parents=True, exist_ok=True)
    groups = read_caption_groups(args.captions or DEFAULT_TEXTS)[: args.max_photos or None]
    model = [f"model.name={args.model}", f"model.pretrained={args.pretrained or 'null'}"]
    if args.model_config:
        model.append(f"model.config={args.model_config}")
    common = [*model, "data.captions=null", "data.images=null", f"data.image_embeddings={work / 'photos.npz'}",
              f"data.paraphrases.dataset={args.paraphrases or work / 'paraphrases.jsonl'}",
              f"objective.anchor_bank={work / 'bank'}", "train.checkpoint_every=1000000", "train.log_every=1",
              *([f"train.device={args.device}"] if args.device else []), *args.set]
    recipe = load_recipe(args.recipe, [*common, f"train.batch_size={args.batch_sizes[0]}"])
    # the texts a step counts are the paraclip objective's (x, x', x'' of each row)
    if recipe.model.kind != "open_clip" or recipe.objective.anchor_target != "bank" or recipe.objective.kind != "paraclip":
        raise UserError(f"--recipe: {args.recipe} is not an open_clip recipe with a bank anchor and the paraclip "
                        "objective (the built-in robust-openclip, without --set changing these, is)")
    epochs = recipe.train.epochs
    if epochs is None:
        raise UserError("train.epochs: the run to project needs the recipe's epochs (train.steps is the bench's own)")
    one_off: dict[str, float] = {}
    seed_everything(recipe.train.seed)  # the trainer's own seed: the same random-initialised weights as its tower
    started = time.perf_counter()
    _, frozen = build_model(recipe, run_dir)  # exports run/base-bundle, which the trainer then reuses
    one_off["export_frozen_bundle_s"] = time.perf_counter() - started
    photo_embeddings(groups, frozen.dim, frozen.image_space, work / "photos.npz")
    bank_texts = read_caption_texts(args.bank_captions or DEFAULT_TEXTS)[: args.max_bank or None]
    started = time.perf_counter()
    CaptionBank.build(Encoder(run_dir / "base-bundle", load_image=False), bank_texts, work / "bank")
    one_off["bank_s"] = time.perf_counter() - started

    rows: list[dict] = []
    result = {"recipe": args.recipe, "model": args.model, "pretrained": args.pretrained or "random-init",
              "photos_in_data": len(groups), "bank_captions": len(bank_texts), "photos": args.photos,
              "epochs": epochs, "one_off": one_off, "rows": rows}
    runs = [(chunk, kept, batch_size) for batch_size in args.batch_sizes for chunk in args.encode_chunks
            for kept in args.token_cache]
    for i, (chunk, kept, batch_size) in enumerate(runs):
        recipe = load_recipe(args.recipe, [*common, f"train.batch_size={batch_size}", f"train.steps={args.warmup + args.steps}"])
        for stale in ("checkpoint.pt", "metrics.jsonl"):  # each batch size starts its own run
            (run_dir / stale).unlink(missing_ok=True)
        started = time.perf_counter()
        trainer = Trainer(recipe, run_dir)
        if i == 0:  # x″ generation and the anchor targets: cached in the run folder for the next sizes
            one_off["setup_s"] = time.perf_counter() - started
        for tower in (trainer.tower, trainer.original):
            if tower is not None:
                tower.encode_chunk = chunk
                tower.keep_token_ids(CachedClipTokenizer.LIMIT if kept == "on" else 0)
        if trainer.device.type == "cuda":
            torch.cuda.synchronize(trainer.device)
            torch.cuda.reset_peak_memory_stats(trainer.device)
        try:
            trainer.fit(progress=False)
        except torch.cuda.OutOfMemoryError:  # what the run needs: a smaller batch, or gradient accumulation
            rows.append({"batch_size": batch_size, "encode_chunk": chunk, "token_cache": kept, "device": str(trainer.device),
                         "error": "out of memory"})
            del trainer
            torch.cuda.empty_cache()
            after_row(result)
            continue
        seconds = [json.loads(line)["seconds"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        median = statistics.median(seconds[args.warmup:])
        o, d = recipe.objective, recipe.data
        text_sets = len(trainer.data.text_groups or [])
        per_step = texts_per_step(len(trainer.data.captions), text_sets, o.preserve_per_batch if o.preserve_weight > 0 else 0,
                                  batch_size, d.text_per_batch)
        steps = run_steps(args.photos, batch_size, text_sets, d.text_per_batch, epochs)
        batch = sample_batch(trainer.data, 0, batch_size, recipe.train.seed, True, d.text_per_batch)
        texts = batch.x + batch.x1 + batch.x2
        tokenize_s = statistics.median(_seconds(trainer.tower.tokenize, texts) for _ in range(3))
        rows.append({"batch_size": batch_size, "text_per_batch": d.text_per_batch, "encode_chunk": chunk, "token_cache": kept,
                     "device": str(trainer.device),
                     "amp": bool(recipe.train.amp and trainer.device.type == "cuda"), "step_s": median,
                     "texts_per_step": per_step, "texts_per_s": per_step / median, "tokenize_s": tokenize_s,
                     "peak_gib": peak_memory_gib(trainer.device), "run_steps": steps, "run_minutes": steps * median / 60})
        del trainer
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        after_row(result)
    return result


def report(result: dict) -> list[str]:
    o = result["one_off"]
    lines = [f"recipe {result['recipe']}: {result['model']} ({result['pretrained']}); {result['photos_in_data']} photos "
             f"(random unit vectors), bank of {result['bank_captions']} captions",
             f"one-off: frozen tower's bundle {o['export_frozen_bundle_s']:.1f} s, bank {o['bank_s']:.1f} s, "
             f"setup (x'' rewrites, anchor targets) {o['setup_s']:.1f} s",
             f"{'batch':>6} {'+sets':>6} {'chunk':>6} {'ids':>4} {'device':>8} {'amp':>4} {'step s':>8} {'texts/step':>10} {'texts/s':>8} "
             f"{'tokenize s':>10} {'peak GiB':>9} {'run steps':>9} {'run min':>8}"]
    for r in result["rows"]:
        if "error" in r:
            lines.append(f"{r['batch_size']:>6} {'':>6} {r['encode_chunk'] or 'one':>6} {r['token_cache']:>4} {r['device']:>8} "
                         f"{r['error']}")
            continue
        lines.append(f"{r['batch_size']:>6} {r['text_per_batch']:>6} {r['encode_chunk'] or 'one':>6} {r['token_cache']:>4} "
                     f"{r['device']:>8} "
                     f"{'bf16' if r['amp'] else 'no':>4} "
                     f"{r['step_s']:>8.3f} {r['texts_per_step']:>10} {r['texts_per_s']:>8.0f} {r['tokenize_s']:>10.3f} {r['peak_gib']:>9.2f} "
                     f"{r['run_steps']:>9} {r['run_minutes']:>8.1f}")
    lines.append(f"run: {result['photos']} photos x {result['epochs']:g} epochs at the median step time "
                 "(one-off costs and the final export not included); chunk: texts per forward pass, by length "
                 "(one: the whole call padded to its longest); ids: token ids kept between steps (on) or not")
    return lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--recipe", default="robust-openclip")
    p.add_argument("--model", default="ViT-B-32", help="open_clip model name")
    p.add_argument("--model-config", default=None, help="an open_clip model config file (a model of your own)")
    p.add_argument("--pretrained", default=None, help="open_clip tag or checkpoint file (default: random-initialised)")
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[256, 1024])
    p.add_argument("--encode-chunks", type=int, nargs="+", default=[512],
                   help="texts per forward pass, sorted by length (0: one pass padded to the longest); each is run")
    p.add_argument("--token-cache", nargs="+", choices=["on", "off"], default=["on"],
                   help="keep each text's token ids between steps (open_clip towers), or tokenise every step; each is run")
    p.add_argument("--steps", type=int, default=10, help="timed steps per batch size (median reported)")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps first (allocation, kernel choice)")
    p.add_argument("--photos", type=int, default=COCO_TRAIN_PHOTOS, help="photos of the run to project")
    p.add_argument("--captions", type=Path, default=None, help="the photos' caption groups (image_id/caption TSV; "
                   "default: the shipped COCO caption sets)")
    p.add_argument("--max-photos", type=int, default=0, help="use only the first N caption groups (0: all)")
    p.add_argument("--bank-captions", type=Path, default=None, help="the bank's captions (default: the shipped COCO captions)")
    p.add_argument("--max-bank", type=int, default=0, help="use only the first N bank captions (0: all)")
    p.add_argument("--paraphrases", type=Path, default=None, help="a paraphrases.jsonl of an earlier run to resume")
    p.add_argument("--device", default=None, help="train.device (default: the first GPU, else the CPU)")
    p.add_argument("--set", action="append", default=[], help="more recipe overrides, as `paraseek train --set`")
    p.add_argument("--work", type=Path, default=None, help="work folder (default: a temporary one)")
    p.add_argument("--json", type=Path, default=None, help="also write the result here (rewritten after each row)")
    args = p.parse_args(argv)
    if args.steps < 1 or args.warmup < 0:
        p.error("--steps must be >= 1 and --warmup >= 0")
    print(f"machine: {cpu_description()}")
    print(f"accelerators: {gpu_description()}")
    try:
        result = bench(args, after_row=lambda so_far: args.json and args.json.write_text(json.dumps(so_far, indent=2) + "\n"))
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print("\n".join(report(result)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
