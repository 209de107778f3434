"""``paraseek models ...`` and ``paraseek train``: export, quantise and inspect bundles; train text
towers from recipes. torch is imported inside the commands that export or train (lazily, because it
is a heavy optional dependency), so ``paraseek models info`` and ``--help`` run without it."""

from __future__ import annotations

from pathlib import Path
from typing import List, Optional

import typer

from paraseek.core.bundle import read_manifest
from paraseek.core.cli_support import console, user_errors
from paraseek.core.demo import demo_captions
from paraseek.core.encoder import Encoder
from paraseek.core.errors import UserError
from paraseek.core.settings import Settings
from paraseek.evaluation.data import held_out_texts, without_held_out
from paraseek.paraphrase.caption_bank import DEFAULT_TEXTS, CaptionBank, bank_dir, configured_bank_dir, read_caption_texts
from paraseek.paraphrase.query_head import HEAD_FILE, HeadTraining, check_blend
from paraseek.training.export.quantize import DEFAULT_KEEP_FP32, KEEP_FP32, quantize_text_tower  # onnxruntime only, no torch
from paraseek.training.export.starter_release import CROP_GRID
from paraseek.training.recipe import list_recipes, load_recipe

models_app = typer.Typer(help="Build, export, quantise and inspect model bundles.", no_args_is_help=True)


def _quantize(out: Path, int8: bool) -> None:
    if int8:
        spec = quantize_text_tower(out, demo_captions())
        console.print(f"int8 text tower: cosine vs fp32 mean {spec.cosine_vs_fp32_mean:.4f}, min {spec.cosine_vs_fp32_min:.4f}")


@models_app.command("build-starter")
@user_errors
def build_starter_cmd(
    out: Path = typer.Option(None, help="Bundle directory (default: $PARASEEK_HOME/bundles/starter, or starter-robust)."),
    int8: bool = typer.Option(True, help="Also write the int8 text tower."),
    robust: bool = typer.Option(False, help="The robust variant: the text tower carries the tuned layers the package ships "
                                "(training/recipes/robust-starter.yaml); same image tower and image_space."),
    train: bool = typer.Option(False, help="With --robust: train those layers here from the shipped data first "
                               "(resumable: rerun to continue), instead of using the shipped ones."),
    run_dir: Optional[Path] = typer.Option(None, help="With --train: the run directory (default: $PARASEEK_HOME/runs/robust-starter)."),
    set_: List[str] = typer.Option([], "--set", help="With --train: override a recipe field, e.g. train.epochs=1 (repeatable)."),
    crop_grid: int = typer.Option(CROP_GRID, min=0, max=4, help="Crops per side the image classifier also sees, each half the "
                                  "photo's size. 0: the whole photo only, one classifier pass per photo instead of ten "
                                  "(indexing 7.7x faster on 2 cores; image queries) for lower recall (plain starter T2I R@10 77.4 against "
                                  "82.0 with 3 on COCO-mini val); its own image space, starter v2's."),
):
    """Build the offline starter dual encoder (MiniLM text + EfficientNet-Lite0 image) as a bundle."""
    if (train or set_ or run_dir) and not robust:
        raise UserError("--train, --set and --run-dir apply to --robust only")
    from paraseek.training.export.starter import ROBUST_LAYERS, build_starter  # torch

    settings = Settings()
    out = out or (settings.robust_starter_bundle_dir if robust else settings.plain_starter_bundle_dir)
    layers = None
    if robust:
        layers = ROBUST_LAYERS
        if train:
            from paraseek.training.robust import train_robust_layers  # torch

            layers = train_robust_layers(settings, run_dir or settings.home / "runs" / "robust-starter", set_)
    manifest = build_starter(out, int8=int8, tuned_layers=layers, crop_grid=crop_grid)
    console.print(f"{manifest.name} bundle written to {out} (dim {manifest.embedding_dim}, image_space {manifest.image_space})")


@models_app.command("export-openclip")
@user_errors
def export_openclip_cmd(
    model: str = typer.Argument("", help="open_clip model name, e.g. ViT-B-32 (or empty with --model-config)."),
    out: Path = typer.Option(..., help="Bundle directory to write."),
    pretrained: Optional[str] = typer.Option(None, help="open_clip pretrained tag or a local checkpoint file."),
    model_config: Optional[Path] = typer.Option(None, help="JSON architecture config (registered under its file stem)."),
    image_space: Optional[str] = typer.Option(None, help="Override the image-space id (keep it for text-only fine-tunes)."),
    no_image: bool = typer.Option(False, "--no-image", help="Export the text tower only."),
    int8: bool = typer.Option(False, help="Also write an int8 text tower and report its agreement."),
    name: Optional[str] = typer.Option(None),
    version: str = typer.Option("1"),
):
    """Export an open_clip model (both towers) to a bundle."""
    if not model and model_config is None:
        raise UserError("give an open_clip model name or --model-config")
    from paraseek.training.export.openclip import export_open_clip  # torch

    manifest = export_open_clip(
        model, out, pretrained=pretrained, model_config=model_config, name=name, version=version,
        image_space=image_space, include_image=not no_image,
    )
    _quantize(out, int8)
    console.print(f"bundle {manifest.name} written to {out} (image_space {manifest.image_space})")


def _evaluation_data(eval_pairs: Path | None, eval_images: Path | None) -> tuple[Path, Path] | None:
    """(pairs, images) to measure two text towers side by side on, or None; one without the other is an error."""
    if (eval_pairs is None) != (eval_images is None):
        raise UserError("give both --eval-pairs and --eval-images, or neither")
    return (eval_pairs, eval_images) if eval_pairs is not None and eval_images is not None else None


@models_app.command("quantize")
@user_errors
def quantize_cmd(
    bundle: Path = typer.Argument(..., help="Bundle directory."),
    eval_pairs: Optional[Path] = typer.Option(None, help="Paraphrase pairs (TSV) to measure AO@10 on, fp32 vs int8."),
    eval_images: Optional[Path] = typer.Option(None, help="Images (COCO JSON or folder) to search and measure T2I R@10 on."),
    keep_fp32: Optional[str] = typer.Option(
        None, help=f"Which weight products stay fp32: {', '.join(KEEP_FP32)} (fastest first), or auto: the fastest "
        "that qualifies on --eval-pairs/--eval-images. Default: the bundle's current int8 policy, else "
        f"{DEFAULT_KEEP_FP32}."),
):
    """Write (or rewrite) the int8 text tower; with --eval-pairs/--eval-images also measure it against
    fp32 and record that in the manifest, which `auto` precision (the service default) needs to serve it."""
    evaluate_on = _evaluation_data(eval_pairs, eval_images)
    if keep_fp32 is not None and keep_fp32 not in (*KEEP_FP32, "auto"):
        raise UserError(f"--keep-fp32 must be one of {', '.join(KEEP_FP32)} or auto, not {keep_fp32!r}")
    if keep_fp32 == "auto" and evaluate_on is None:
        raise UserError("--keep-fp32 auto measures each policy: give --eval-pairs and --eval-images")
    spec = quantize_text_tower(bundle, demo_captions(), evaluate_on=evaluate_on, keep_fp32=keep_fp32)
    console.print(f"int8 text tower ({spec.keep_fp32} kept fp32): cosine vs fp32 mean {spec.cosine_vs_fp32_mean:.4f}, "
                  f"min {spec.cosine_vs_fp32_min:.4f}")
    if spec.evaluation is not None:
        e = spec.evaluation
        console.print(f"AO@10 fp32 {e.ao_at_10['fp32']:.2f} int8 {e.ao_at_10['int8']:.2f}; "
                      f"T2I R@10 fp32 {e.t2i_r_at_10['fp32']:.2f} int8 {e.t2i_r_at_10['int8']:.2f}")
    ok, why = spec.qualifies()
    console.print(f"auto precision serves {'int8' if ok else 'fp32'}: {why}")


@models_app.command("fp16")
@user_errors
def fp16_cmd(bundle: Path = typer.Argument(..., help="Bundle directory.")):
    """Write (or rewrite) the half-precision text tower that `auto` precision serves on a GPU (CUDA or
    TensorRT execution provider) when it agrees with fp32 (cosine >= 0.999 on every calibration text)."""
    from paraseek.training.export.fp16 import half_text_tower  # onnxruntime and onnx, no torch

    spec = half_text_tower(bundle, demo_captions())
    ok, why = spec.qualifies()
    console.print(f"fp16 text tower: {why}; auto precision on a GPU serves {'fp16' if ok else 'fp32'}")


@models_app.command("optimize")
@user_errors
def optimize_cmd(
    bundle: Path = typer.Argument(..., help="Bundle directory."),
    eval_pairs: Optional[Path] = typer.Option(None, help="Paraphrase pairs (TSV): AO@10 of the exported vs the fused text tower."),
    eval_images: Optional[Path] = typer.Option(None, help="Images (COCO JSON or folder) to search and measure T2I R@10 on."),
    any_fusion: bool = typer.Option(False, help="Keep a fused tower that agrees even without a fused Attention "
                                    "(layer norms, GELUs, MultiHeadAttention: 4-10 % slower than exported on CLIP)."),
):
    """Fuse the towers' transformer operators (attention, skip layer norm, bias GELU) where the fused
    graph agrees with the exported one and holds a fused Attention, for a bundle exported without it (exporters do it by default);
    an int8 text tower is rebuilt from the fused graph with its keep-fp32 policy."""
    from paraseek.core.bundle import write_manifest
    from paraseek.training.export.graph_optimize import optimize_bundle

    evaluate_on = _evaluation_data(eval_pairs, eval_images)
    manifest = read_manifest(bundle)
    int8, fp16 = manifest.text_int8, manifest.text_fp16
    if int8 is not None or fp16 is not None:  # made from the unfused graph: out of the bundle until rebuilt
        write_manifest(bundle, manifest.model_copy(update={"text_int8": None, "text_fp16": None}))
    done = optimize_bundle(bundle, demo_captions(), evaluate_on=evaluate_on, any_fusion=any_fusion)
    for tower, opt in done.items():
        ops = ", ".join(f"{n} {op}" for op, n in opt.operators.items())
        console.print(f"{tower} tower fused ({ops}): cosine to exported mean {opt.cosine_vs_exported_mean:.6f}, "
                      f"min {opt.cosine_vs_exported_min:.6f}")
        if opt.evaluation is not None:
            e = opt.evaluation
            console.print(f"AO@10 exported {e.ao_at_10['exported']:.2f} optimized {e.ao_at_10['optimized']:.2f}; "
                          f"T2I R@10 exported {e.t2i_r_at_10['exported']:.2f} optimized {e.t2i_r_at_10['optimized']:.2f}")
    if not done:
        console.print("nothing fused: the towers are already optimised, the rewriter found no pattern it fuses, "
                      "or it fused no Attention (see --any-fusion)")
    if int8 is not None:
        spec = quantize_text_tower(bundle, demo_captions(), evaluate_on=evaluate_on, keep_fp32=int8.keep_fp32)
        console.print(f"int8 text tower rebuilt ({spec.keep_fp32} kept fp32): auto precision serves "
                      f"{'int8' if spec.qualifies()[0] else 'fp32'}: {spec.qualifies()[1]}")
    if fp16 is not None:
        from paraseek.training.export.fp16 import half_text_tower

        half = half_text_tower(bundle, demo_captions())
        console.print(f"fp16 text tower rebuilt: {half.qualifies()[1]}")


@models_app.command("export-hf")
@user_errors
def export_hf_cmd(
    model_dir: Path = typer.Argument(..., help="Local Hugging Face sentence-encoder directory."),
    out: Path = typer.Option(..., help="Bundle directory to write."),
    image_space: Optional[str] = typer.Option(None, help="Image-space id the encoder is aligned to."),
    int8: bool = typer.Option(False, help="Also write an int8 text tower."),
    name: Optional[str] = typer.Option(None),
    version: str = typer.Option("1"),
):
    """Export a Hugging Face sentence encoder (mean pooling) to a text bundle."""
    from paraseek.training.export.hf_text import export_hf_text  # torch

    manifest = export_hf_text(model_dir, out, name=name, version=version, image_space=image_space)
    _quantize(out, int8)
    console.print(f"bundle {manifest.name} written to {out}")


@models_app.command("build-bank")
@user_errors
def build_bank_cmd(
    bundle: Optional[Path] = typer.Option(None, help="Bundle whose text tower embeds the bank (default: the configured one)."),
    captions: Optional[Path] = typer.Option(None, help="Captions: one per line (.txt, .txt.gz) or a TSV with a caption "
                                            "column (default: the shipped COCO captions). Never the indexed gallery's own."),
    out: Optional[Path] = typer.Option(None, help="Bank folder (default: the bundle's bank under $PARASEEK_HOME)."),
    hold_out: List[Path] = typer.Option([], help="Paraphrase pairs you evaluate on (the `paraseek eval --pairs` TSV; "
                                        "repeatable): captions equal to one of their texts are left out of the bank."),
):
    """Embed a caption bank for query expansion (expansion method 'bank')."""
    settings = Settings()
    encoder = Encoder(bundle or settings.bundle_dir, load_image=False)
    texts = read_caption_texts(captions or DEFAULT_TEXTS)
    if hold_out:
        held_out = held_out_texts(hold_out)
        kept = without_held_out(texts, held_out)
        if not kept:
            raise UserError("--hold-out: every caption of the bank is a text of the held-out pairs")
        console.print(f"{len(texts) - len(kept)} captions left out: they are texts of the held-out pairs")
        texts = kept
    target = out or bank_dir(settings.home, encoder.manifest)
    bank = CaptionBank.build(encoder, texts, target, texts_source=(captions or DEFAULT_TEXTS).name)
    console.print(f"caption bank: {bank.manifest.count} captions embedded by {encoder.name} v{encoder.version} in {target}")


@models_app.command("train-head")
@user_errors
def train_head_cmd(
    bundle: Optional[Path] = typer.Option(None, help="Bundle the bank was embedded by (default: the configured one)."),
    bank: Optional[Path] = typer.Option(None, help="Bank folder (default: the bundle's bank under $PARASEEK_HOME)."),
    neighbours: int = typer.Option(HeadTraining.neighbours, min=1, help="The mean shift to learn: neighbours a round."),
    rounds: int = typer.Option(HeadTraining.rounds, min=1, help="The mean shift to learn: rounds."),
    hidden: int = typer.Option(HeadTraining.hidden, min=1, help="Width of the head's hidden layers."),
    layers: int = typer.Option(HeadTraining.layers, min=1, help="Hidden layers."),
    steps: int = typer.Option(HeadTraining.steps, min=1, help="Optimiser steps (batches of 512 captions)."),
    seed: int = typer.Option(HeadTraining.seed),
    teacher: Optional[Path] = typer.Option(None, help="Learn this bundle's retrieval vector instead of the mean shift: a "
                                           "bundle of the same image space (e.g. the robust starter) embeds the bank's "
                                           "captions and the head learns to output that from this bundle's vectors."),
    teacher_bank: Optional[Path] = typer.Option(None, help="With --teacher: a bank of the teacher's holding a query head; "
                                                "the teacher's vectors are moved by it (--teacher-blend of the way)."),
    teacher_blend: float = typer.Option(1.0, help="With --teacher-bank: the share of its head's move in the target (the "
                                        "plain starter's shipped head: 1; at query time `blend` dials it down)."),
    rewrites: Optional[int] = typer.Option(None, min=0, help="With --teacher: also learn from this many rewritten copies of "
                                           "each caption (WordNet synonyms, dropped words; needs NLTK's WordNet). "
                                           "Default 2 with --teacher."),
):
    """Train the caption bank's query head (expansion method 'head'): its mean shift learnt as a function of
    the query, so the served expansion needs fewer bank lookups, or none; or, with --teacher, another
    bundle's retrieval vector. Written into the bank's folder."""
    from paraseek.training.query_head import teacher_data, train_query_head  # torch

    settings = Settings()
    encoder = Encoder(bundle or settings.bundle_dir, load_image=False)
    path = bank or configured_bank_dir(settings, encoder.manifest)
    if not (path / "manifest.json").is_file():
        raise UserError(f"--bank: no caption bank in {path}: build one with `paraseek models build-bank`")
    loaded = CaptionBank.load(path, encoder)
    cfg = HeadTraining(neighbours=neighbours, rounds=rounds, hidden=hidden, layers=layers, steps=steps, seed=seed)
    targets, learnt_from, rewritten = None, None, None
    if teacher is None and (teacher_bank is not None or rewrites):
        raise UserError(f"{'--teacher-bank' if teacher_bank else '--rewrites'}: only with a --teacher bundle")
    if teacher is not None:
        taught = Encoder(teacher, load_image=False)
        if (taught.image_space, taught.dim) != (encoder.image_space, encoder.dim):
            raise UserError(f"--teacher: {taught.name} ranks in {taught.image_space} ({taught.dim} dimensions), "
                            f"{encoder.name} in {encoder.image_space} ({encoder.dim}): a head can only learn a teacher "
                            "of the same image space")
        check_blend(teacher_blend)
        teacher_head = None
        if teacher_bank is not None:
            teacher_head = CaptionBank.load(teacher_bank, taught).head if (teacher_bank / "manifest.json").is_file() else None
            if teacher_head is None:
                raise UserError(f"--teacher-bank: no caption bank with a query head in {teacher_bank}")
        copies = 2 if rewrites is None else rewrites
        console.print(f"embedding {len(loaded.texts)} captions and {copies} rewritten copies of each with the teacher "
                      f"{taught.name} v{taught.version} (and the copies with {encoder.name}) ...")
        targets, rewritten = teacher_data(loaded.texts, encoder, taught, teacher_head, teacher_blend, copies, seed)
        learnt_from = f"{taught.name} v{taught.version}" + (f" + its head@{teacher_blend:g}" if teacher_head else "")
    head = train_query_head(loaded.vectors, cfg, progress=lambda step, loss: console.print(f"step {step}: loss {loss:.4f}"),
                            targets=targets, teacher=learnt_from, rewrites=rewritten)
    loaded.with_head(head)
    c = head.config
    target = f"the teacher {c['teacher']}" if c["teacher"] else "the mean shift"
    console.print(f"query head written to {path / HEAD_FILE}: held-out cosine distance to {target} "
                  f"{c['held_out_identity_loss']:.4f} (the query itself) -> {c['held_out_loss']:.4f}, {c['train_s']:.0f} s")


@models_app.command("embed-images")
@user_errors
def embed_images_cmd(
    captions: Path = typer.Option(..., help="COCO-format captions JSON (or any source `paraseek index build` reads) "
                                  "whose captioned photos to embed."),
    out: Path = typer.Option(..., help=".npz to write: the format of a recipe's data.image_embeddings."),
    images: Optional[Path] = typer.Option(None, help="Photo folder (default: beside the captions file)."),
    bundle: Optional[Path] = typer.Option(None, help="Bundle whose frozen image tower embeds them (default: the configured one)."),
    fp16: bool = typer.Option(False, help="Store the vectors as float16 (half the size; how the starter's asset ships)."),
    hold_out: List[Path] = typer.Option([], help="Paraphrase pairs you evaluate on (the `paraseek eval --pairs` TSV; "
                                        "repeatable): captions equal to one of their texts are left out."),
):
    """Embed training photos once with a frozen image tower, for recipes' data.image_embeddings (e.g. on a GPU
    machine, or to remake training/assets/coco_mini_train_starter_images.npz after the starter's image side changes)."""
    from paraseek.training.data import embed_photos, save_image_embeddings, without_texts

    if out.suffix != ".npz":
        raise UserError(f"--out: {out} must end in .npz")
    held_out = held_out_texts(hold_out)
    encoder = Encoder(bundle or Settings().bundle_dir)
    if not encoder.has_image_tower:
        raise UserError(f"--bundle: {encoder.name} v{encoder.version} has no image tower to embed photos with")
    embeddings, skipped = embed_photos(captions, images, encoder)
    for item in skipped:
        console.print(f"skipped {item['path']}: {item['error']}")
    if held_out:
        embeddings, dropped = without_texts(embeddings, held_out)
        console.print(f"{dropped} captions left out: they are texts of the held-out pairs")
    save_image_embeddings(out, embeddings, encoder.image_space, fp16=fp16)
    console.print(f"{len(embeddings.ids)} photos embedded by {encoder.name} v{encoder.version} "
                  f"(image space {encoder.image_space}), {len(skipped)} skipped: {out}")


@models_app.command("info")
@user_errors
def info_cmd(bundle: Path = typer.Argument(None, help="Bundle directory (default: the configured bundle).")):
    """Verify a bundle's checksums and print its manifest."""
    console.print_json(read_manifest(bundle or Settings().bundle_dir).model_dump_json())


@user_errors
def train_cmd(
    recipe: str = typer.Argument(None, help="Recipe YAML file, or the name of a built-in recipe."),
    set_: List[str] = typer.Option([], "--set", help="Override a field: train.lr=1e-5 (repeatable)."),
    output: Optional[Path] = typer.Option(None, help="Run directory (default: the recipe's output or runs/<name>)."),
    max_steps: Optional[int] = typer.Option(None, min=1, help="Stop after this many steps (resume later)."),
    list_: bool = typer.Option(False, "--list", help="List the built-in recipes."),
):
    """Train a text encoder from a recipe; resumes from the run directory's checkpoint; exports a bundle.

    Multi-GPU: torchrun --nproc-per-node N -m paraseek.cli train RECIPE
    """
    if list_ or recipe is None:
        console.print("\n".join(list_recipes()))
        return
    spec = load_recipe(recipe, set_)  # validated before torch is imported
    from paraseek.training.trainer import train  # torch

    result = train(spec, output, max_steps=max_steps)
    console.print(f"{result.steps} steps, loss {result.first_loss:.4f} -> {result.last_loss:.4f}; run in {result.run_dir}")
    if (result.bundle / "manifest.json").is_file():
        console.print(f"bundle: {result.bundle}")
