"""The model bundle format: the one description of an encoder that training, index and service share.

A bundle is a directory::

    manifest.json      what this module reads and writes (``BundleManifest``)
    text.onnx          text tower: (input_ids[, attention_mask]) -> embeddings, dynamic batch and length
    text.int8.onnx     optional dynamically quantised text tower (CPU)
    text.fp16.onnx     optional half-precision text tower (GPU), float32 inputs and outputs
    image.onnx         optional image tower: pixel_values (B, 3, H, W) float32 -> embeddings
    tokenizer.json     a Hugging Face ``tokenizers`` file (no torch needed to tokenise)

Every file is listed in the manifest with its sha256, so a missing or altered file is caught at load
time with an error that names it.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from paraseek.core.errors import UserError
from paraseek.core.integrity import checksums, verify_checksums

MANIFEST = "manifest.json"
FORMAT_VERSION = 1


class BundleError(UserError):
    """A bundle cannot be used: missing, altered or malformed files."""


class TokenizerSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")

    file: str = "tokenizer.json"
    # "clip": open_clip's text cleaning (ftfy, html unescape, whitespace, lowercase) runs before the
    # tokenizer file, so ids match open_clip's own tokenizer. "none": the tokenizer file does it all.
    cleaning: Literal["clip", "none"] = "none"
    pad_id: int = 0

    @model_validator(mode="before")
    @classmethod
    def _drop_retired_fields(cls, data):
        # bundles written before 0.2 carry `uses_attention_mask`, which nothing read (the text
        # tower's input_names say whether it takes a mask): accept and ignore it
        if isinstance(data, dict):
            data = {k: v for k, v in data.items() if k != "uses_attention_mask"}
        return data


class ImagePreprocess(BaseModel):
    """How pixels become the image tower's input (resize shortest side, centre crop, normalise).

    With ``crop_grid`` > 0 the tower sees more than the centre of the whole photo: its input is
    (views, 3, size, size) per photo, view 0 the whole photo and then ``crop_grid`` x ``crop_grid``
    overlapping crops (row by row), each ``crop_scale`` of the photo's width and height, every view
    preprocessed as the whole photo is. The tower's graph decides how the views combine."""

    model_config = ConfigDict(extra="forbid")

    size: int = 224
    resize: Literal["shortest", "squash"] = "shortest"
    interpolation: Literal["bicubic", "bilinear"] = "bicubic"
    mean: tuple[float, float, float] = (0.48145466, 0.4578275, 0.40821073)
    std: tuple[float, float, float] = (0.26862954, 0.26130258, 0.27577711)
    crop_grid: int = Field(0, ge=0, le=4, description="crops per side beside the whole photo (0: the whole photo only)")
    crop_scale: float = Field(0.5, gt=0.0, lt=1.0, description="each crop's share of the photo's width and height")

    @property
    def views(self) -> int:
        """Views per photo the image tower takes: 1, or the whole photo and its crops."""
        return 1 + self.crop_grid**2


class AgreementEvaluation(BaseModel):
    """Two graphs of one tower measured side by side: paraphrase stability and retrieval, in points."""

    pairs: str = Field(description="the paraphrase pairs file")
    images: str = Field(description="the image collection searched")
    ao_at_10: dict[str, float] = Field(description="graph -> AO@10 on the pairs, 0-100")
    t2i_r_at_10: dict[str, float] = Field(description="graph -> text-to-image R@10 on the images' captions, 0-100")

    def loss(self, reference: str, candidate: str) -> float:
        """The larger drop from ``reference`` to ``candidate`` of the two metrics (negative: it scored higher)."""
        return max(self.ao_at_10[reference] - self.ao_at_10[candidate],
                   self.t2i_r_at_10[reference] - self.t2i_r_at_10[candidate])


class GraphOptimization(BaseModel):
    """Fused transformer operators that replaced the exported graph, and how close it stayed to it."""

    model_config = ConfigDict(extra="forbid")

    tool: str = Field(description="what fused the graph, with its version")
    operators: dict[str, int] = Field(description="fused (onnxruntime contrib) operator -> how many the graph holds")
    cosine_vs_exported_mean: float
    cosine_vs_exported_min: float
    evaluation: AgreementEvaluation | None = Field(
        None, description="exported vs optimised on paraphrase pairs and retrieval, keys 'exported' and 'optimized'")


class TowerSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")

    file: str
    input_names: list[str]
    output_name: str = "embeddings"
    optimization: GraphOptimization | None = Field(None, description="graph fusions applied at export, if any")


# int8 serves by default ("auto" precision) only when it agrees with fp32 and costs no quality
INT8_MIN_COSINE = 0.99
INT8_MAX_LOSS_POINTS = 0.5


class Int8Evaluation(AgreementEvaluation):
    """fp32 and int8 measured side by side at export (keys 'fp32' and 'int8')."""

    @property
    def loss_points(self) -> float:
        return self.loss("fp32", "int8")


class QuantizedSpec(TowerSpec):
    keep_fp32: str | None = Field(None, description="which weight products the quantiser left fp32 (a policy name)")
    # mean cosine similarity between int8 and fp32 embeddings on the calibration texts at export
    cosine_vs_fp32_mean: float
    cosine_vs_fp32_min: float
    evaluation: Int8Evaluation | None = Field(None, description="fp32 vs int8 on held-out pairs, measured at export")

    def qualifies(self) -> tuple[bool, str]:
        """Whether ``auto`` precision picks this tower, and why (or why not)."""
        if self.cosine_vs_fp32_mean < INT8_MIN_COSINE:
            return False, f"mean cosine to fp32 {self.cosine_vs_fp32_mean:.4f} < {INT8_MIN_COSINE}"
        if self.evaluation is None:
            return False, "no fp32-vs-int8 evaluation recorded at export"
        if self.evaluation.loss_points > INT8_MAX_LOSS_POINTS:
            return False, f"int8 loses {self.evaluation.loss_points:.2f} points (AO@10 or T2I R@10) > {INT8_MAX_LOSS_POINTS}"
        return True, (f"mean cosine {self.cosine_vs_fp32_mean:.4f}, loss {self.evaluation.loss_points:.2f} points "
                      f"on {self.evaluation.pairs}")


# fp16 serves by default on a GPU only when it agrees with fp32 this closely (rounding the weights
# to half precision alone gives ~0.99999 on the starters)
FP16_MIN_COSINE = 0.999


class HalfSpec(TowerSpec):
    # cosine similarity between fp16 and fp32 embeddings on the calibration texts at export
    cosine_vs_fp32_mean: float
    cosine_vs_fp32_min: float

    def qualifies(self) -> tuple[bool, str]:
        """Whether ``auto`` precision picks this tower on a GPU, and why (or why not)."""
        if self.cosine_vs_fp32_min < FP16_MIN_COSINE:
            return False, f"min cosine to fp32 {self.cosine_vs_fp32_min:.5f} < {FP16_MIN_COSINE}"
        return True, f"cosine to fp32 mean {self.cosine_vs_fp32_mean:.6f}, min {self.cosine_vs_fp32_min:.6f}"


class BundleManifest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    format_version: int = FORMAT_VERSION
    name: str
    version: str
    embedding_dim: int = Field(gt=0)
    max_tokens: int = Field(gt=1, description="context length; longer inputs are truncated")
    normalize: bool = True
    image_space: str = Field(
        min_length=1,
        description="id of the image encoder this text tower is aligned to; indexes built with one "
        "image_space can be searched by any bundle with the same id",
    )
    text: TowerSpec
    text_int8: QuantizedSpec | None = None
    text_fp16: HalfSpec | None = None
    image: TowerSpec | None = None
    image_preprocess: ImagePreprocess | None = None
    tokenizer: TokenizerSpec
    # provenance: how the bundle was made (exporter, base weights, recipe, measured numbers); free form
    source: dict = Field(default_factory=dict, description="provenance: how the bundle was made (free form)")
    files: dict[str, str] = Field(default_factory=dict, description="file name -> sha256")


PRECISIONS = ("fp32", "fp16", "int8")


def resolve_precision(manifest: BundleManifest, precision: str, gpu: bool = False) -> str:
    """``auto``: on a GPU, fp16 when the bundle's fp16 tower qualifies (``HalfSpec.qualifies``); on CPU,
    int8 when its int8 tower does (``QuantizedSpec.qualifies``); else fp32. The int8 tower's
    agreement and speed were measured on CPU kernels, and fp16 gains nothing on CPU, where onnxruntime
    computes it in fp32."""
    if precision != "auto":
        return precision
    if gpu:
        return "fp16" if manifest.text_fp16 is not None and manifest.text_fp16.qualifies()[0] else "fp32"
    return "int8" if manifest.text_int8 is not None and manifest.text_int8.qualifies()[0] else "fp32"


def image_tower_digest(manifest: BundleManifest) -> str | None:
    """What an image's vector depends on besides its pixels: the image tower's weights (their sha256),
    its preprocessing and the output normalisation, hashed into one id. Two bundles with the same id
    embed a photo alike, so a build may reuse the vectors of unchanged photos from a snapshot recorded
    with it. None for a bundle without an image tower."""
    if manifest.image is None or manifest.image_preprocess is None:
        return None
    weights = manifest.files.get(manifest.image.file)
    if weights is None:
        return None
    parts = [weights, manifest.image.model_dump_json(exclude={"optimization"}),
             manifest.image_preprocess.model_dump_json(), str(manifest.normalize)]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:32]


def bundle_digest(manifest: BundleManifest) -> str:
    """What a text vector of this bundle depends on, hashed into one id: the manifest, which holds the
    sha256 of every file. A retrained bundle re-exported under the same name and version gets another,
    so caches keyed by it never serve the old model's vectors."""
    return hashlib.sha256(manifest.model_dump_json().encode()).hexdigest()[:16]


def _referenced_files(manifest: BundleManifest) -> list[str]:
    names = [manifest.text.file, manifest.tokenizer.file]
    if manifest.text_int8:
        names.append(manifest.text_int8.file)
    if manifest.text_fp16:
        names.append(manifest.text_fp16.file)
    if manifest.image:
        names.append(manifest.image.file)
    return names


def write_manifest(bundle_dir: str | os.PathLike, manifest: BundleManifest) -> BundleManifest:
    """Hash every file the manifest references and write ``manifest.json`` last (atomically)."""
    bundle_dir = Path(bundle_dir)
    names = _referenced_files(manifest)
    for name in names:
        if not (bundle_dir / name).is_file():
            raise BundleError(f"bundle {bundle_dir}: file {name!r} named in the manifest does not exist")
    files = checksums(bundle_dir, names)
    manifest = manifest.model_copy(update={"files": files})
    tmp = bundle_dir / (MANIFEST + ".tmp")
    tmp.write_text(manifest.model_dump_json(indent=2))
    os.replace(tmp, bundle_dir / MANIFEST)
    return manifest


def _inside(bundle_dir: Path, name: str) -> bool:
    """A file name of the manifest is a path inside the bundle folder, links resolved (no absolute path,
    no climbing out with '..' or a link)."""
    try:
        return (bundle_dir / name).resolve().is_relative_to(bundle_dir.resolve()) and not Path(name).is_absolute()
    except (OSError, RuntimeError, ValueError):
        return False


def read_manifest(bundle_dir: str | os.PathLike, verify: bool = True) -> BundleManifest:
    """Read and (by default) verify a bundle. Raises ``BundleError`` naming the offending file."""
    bundle_dir = Path(bundle_dir)
    mpath = bundle_dir / MANIFEST
    if not bundle_dir.is_dir():
        raise BundleError(f"bundle {bundle_dir} is not a directory")
    if not mpath.is_file():
        raise BundleError(f"bundle {bundle_dir}: {MANIFEST} is missing")
    try:
        manifest = BundleManifest.model_validate(json.loads(mpath.read_text()))
    except (json.JSONDecodeError, ValidationError) as exc:
        raise BundleError(f"bundle {bundle_dir}: {MANIFEST} is malformed: {exc}") from exc
    if manifest.format_version != FORMAT_VERSION:
        raise BundleError(
            f"bundle {bundle_dir}: format_version {manifest.format_version} is not supported "
            f"(this paraseek reads {FORMAT_VERSION})"
        )
    for name in _referenced_files(manifest):
        if name not in manifest.files:
            raise BundleError(f"bundle {bundle_dir}: {MANIFEST} has no checksum for {name!r}")
        if not _inside(bundle_dir, name):
            raise BundleError(f"bundle {bundle_dir}: {MANIFEST} names {name!r}, which is not a file inside the bundle folder")
    if verify:
        verify_checksums(bundle_dir, manifest.files, "bundle", BundleError)
    return manifest
