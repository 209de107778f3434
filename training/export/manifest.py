"""The one manifest writer of the exporters: every exporter (open_clip, Hugging Face text, starter,
trained towers) describes what it wrote through ``write_export_manifest``."""

from __future__ import annotations

import shutil
from pathlib import Path

from paraseek.core.bundle import BundleManifest, ImagePreprocess, TokenizerSpec, TowerSpec, read_manifest, write_manifest
from paraseek.core.demo import demo_captions
from paraseek.core.errors import UserError
from paraseek.training.export.graph_optimize import optimize_bundle

TEXT_FILE, IMAGE_FILE, TOKENIZER_FILE = "text.onnx", "image.onnx", "tokenizer.json"


def write_export_manifest(
    out_dir: str | Path,
    *,
    name: str,
    version: str,
    embedding_dim: int,
    max_tokens: int,
    image_space: str,
    text_inputs: list[str],
    cleaning: str,
    image_preprocess: ImagePreprocess | None = None,
    source: dict | None = None,
    optimize: bool = True,
    image_tower: TowerSpec | None = None,
) -> BundleManifest:
    """``text.onnx`` + ``tokenizer.json`` (+ ``image.onnx`` when ``image_preprocess`` is given) in
    ``out_dir`` -> a verified ``manifest.json`` with their sha256s. ``optimize``: replace the towers
    by their fused graphs where those agree with the exported ones and gain from it (``graph_optimize``).
    ``image_tower``: the entry of an ``image.onnx`` copied from another bundle, with its fusion record
    (that tower is not optimised again)."""
    manifest = BundleManifest(
        name=name,
        version=version,
        embedding_dim=embedding_dim,
        max_tokens=max_tokens,
        image_space=image_space,
        text=TowerSpec(file=TEXT_FILE, input_names=text_inputs),
        image=(image_tower or TowerSpec(file=IMAGE_FILE, input_names=["pixel_values"])) if image_preprocess else None,
        image_preprocess=image_preprocess,
        tokenizer=TokenizerSpec(file=TOKENIZER_FILE, cleaning=cleaning, pad_id=0),
        source=source or {},
    )
    manifest = write_manifest(out_dir, manifest)
    if optimize and optimize_bundle(out_dir, demo_captions()):
        manifest = read_manifest(out_dir)
    return manifest


def ship_image_tower(image_bundle: str | Path, out_dir: str | Path, image_space: str) -> tuple[TowerSpec, ImagePreprocess]:
    """Copy the frozen image tower of ``image_bundle`` into ``out_dir``, for a text tower tuned against it:
    -> its manifest entry, fusion record included (``write_export_manifest(image_tower=...)`` does not
    fuse and check it again: minutes for a ViT on a CPU), and its preprocessing."""
    base = read_manifest(image_bundle)
    if base.image is None or base.image_preprocess is None or base.image_space != image_space:
        raise UserError(f"bundle {image_bundle} holds no image tower of image space {image_space!r} to ship")
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    shutil.copyfile(Path(image_bundle) / base.image.file, Path(out_dir) / IMAGE_FILE)
    return base.image.model_copy(update={"file": IMAGE_FILE}), base.image_preprocess
