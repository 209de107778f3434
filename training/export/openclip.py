"""open_clip model (name + pretrained tag, or a local checkpoint) -> model bundle with both towers."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Sequence

import paraseek.training.torch_env  # noqa: F401  (torchvision shim before torch-side imports)
import open_clip
import torch
import torch.nn.functional as F
from torch import nn

from paraseek.core.errors import UserError
from paraseek.core.bundle import BundleManifest, ImagePreprocess
from paraseek.core.integrity import sha256_file
from paraseek.training.export.clip_tokenizer import write_clip_tokenizer
from paraseek.training.export.manifest import IMAGE_FILE, ship_image_tower, write_export_manifest
from paraseek.training.export.onnx_export import export_onnx

log = logging.getLogger(__name__)


def _text_module(model: nn.Module) -> nn.Module:
    """The module holding the text transformer: the CLIP model itself, or ``model.text``."""
    owner = getattr(model, "text", model)
    for attr in ("token_embedding", "positional_embedding", "transformer", "ln_final"):
        if not hasattr(owner, attr):
            raise ValueError(
                f"{type(model).__name__} has no open_clip text transformer ({attr} missing); "
                "towers from Hugging Face text models are exported with `paraseek models export-hf`"
            )
    if getattr(owner, "cls_emb", None) is not None:
        raise ValueError("CoCa-style text towers (appended cls token) are not supported")
    return owner


class ClipTextTower(nn.Module):
    """open_clip's ``encode_text`` run at the batch's own sequence length.

    The text transformer is causal and pools at the end-of-text token, so tokens after it (padding)
    never influence the pooled output: running on ``input_ids[:, :L]`` with the first ``L`` positional
    embeddings and the top-left ``L x L`` block of the causal mask gives the same result as the full
    77-token run, at a fraction of the cost.
    """

    def __init__(self, model: nn.Module, normalize: bool = True):
        super().__init__()
        t = _text_module(model)
        self.token_embedding = t.token_embedding
        self.positional_embedding = t.positional_embedding
        self.transformer = t.transformer
        self.ln_final = t.ln_final
        self.text_projection = t.text_projection
        attn_mask: torch.Tensor = t.attn_mask  # type: ignore[assignment]  # a buffer, typed as Module by __getattr__
        self.register_buffer("attn_mask", attn_mask, persistent=False)
        self.pool_type = getattr(t, "text_pool_type", getattr(t, "pool_type", "argmax"))
        self.eos_id = getattr(t, "text_eos_id", getattr(t, "eos_id", None))
        if self.pool_type not in ("argmax", "eos"):
            raise ValueError(f"text pool type {self.pool_type!r} is not supported for export")
        if self.attn_mask is None:
            raise ValueError("text tower without a causal mask: length truncation would change results")
        self.normalize = normalize

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        length = input_ids.shape[1]
        cast_dtype = self.transformer.get_cast_dtype()
        x = self.token_embedding(input_ids).to(cast_dtype)
        x = x + self.positional_embedding[:length].to(cast_dtype)
        x = self.transformer(x, attn_mask=self.attn_mask[:length, :length])
        x = self.ln_final(x)
        if self.pool_type == "argmax":
            idx = input_ids.argmax(dim=-1)
        else:
            idx = (input_ids == self.eos_id).int().argmax(dim=-1)
        x = x[torch.arange(x.shape[0]), idx]
        if self.text_projection is not None:
            x = self.text_projection(x) if isinstance(self.text_projection, nn.Linear) else x @ self.text_projection
        return F.normalize(x, dim=-1) if self.normalize else x


class ClipImageTower(nn.Module):
    def __init__(self, model: nn.Module, normalize: bool = True):
        super().__init__()
        self.visual = model.visual
        self.normalize = normalize

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        x = self.visual(pixel_values)
        return F.normalize(x, dim=-1) if self.normalize else x


def load_open_clip(
    model_name: str, pretrained: str | None = None, model_config: str | Path | None = None
) -> tuple[nn.Module, dict]:
    """Create an open_clip model. ``model_config`` registers a JSON architecture (configs as data)
    under its file stem; ``pretrained`` is a tag known to open_clip or a local checkpoint file."""
    if model_config is not None:
        model_config = Path(model_config)
        if not model_config.is_file():
            raise FileNotFoundError(f"model config {model_config} does not exist")
        open_clip.add_model_config(model_config)
        model_name = model_name or model_config.stem
    if model_name not in open_clip.list_models():
        raise UserError(f"unknown open_clip model {model_name!r} (see open_clip.list_models())")
    if pretrained and Path(pretrained).exists() is False and Path(pretrained).suffix in (".pt", ".bin", ".safetensors", ".pth"):
        raise FileNotFoundError(f"checkpoint {pretrained} does not exist")
    model = open_clip.create_model(model_name, pretrained=pretrained or None, device="cpu")
    model.eval()
    cfg = open_clip.get_model_config(model_name) or {}
    return model, cfg


def open_clip_image_space(model_name: str, pretrained: str | None) -> str:
    """Id of the image tower: fine-tuning only the text tower keeps it, a new image tower changes it."""
    if pretrained and Path(pretrained).is_file():
        return f"open_clip/{model_name}/ckpt-{sha256_file(Path(pretrained))[:16]}"
    return f"open_clip/{model_name}/{pretrained or 'random-init'}"


def export_open_clip_model(
    model: nn.Module,
    out_dir: str | Path,
    *,
    name: str,
    version: str,
    image_space: str,
    context_length: int = 77,
    image_size: int = 224,
    mean: Sequence[float] | None = None,
    std: Sequence[float] | None = None,
    include_image: bool = True,
    source: dict | None = None,
    optimize: bool = True,
    image_from: Path | None = None,
) -> BundleManifest:
    """Export an in-memory open_clip model (used by the CLI exporter and by training runs); ``optimize``:
    fuse the towers' transformer operators (``graph_optimize``). ``image_from``: a bundle already holding
    this model's image tower (a training run's base bundle: the image tower stays frozen), shipped as it is
    (``ship_image_tower``) instead of exported, fused and checked again."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    text = ClipTextTower(model).eval()
    example = torch.randint(1, 1000, (2, 12))
    example[:, -1] = 49407
    export_onnx(
        text, (example,), out / "text.onnx", ["input_ids"], {"input_ids": {0: "batch", 1: "sequence"}},
        max_sequence=context_length,
    )
    write_clip_tokenizer(out / "tokenizer.json", context_length)
    dim = int(text(example).shape[-1])

    preprocess, image_tower = None, None
    if include_image and image_from is not None:
        image_tower, preprocess = ship_image_tower(image_from, out, image_space)
    elif include_image:
        vis = ClipImageTower(model).eval()
        export_onnx(
            vis, (torch.randn(2, 3, image_size, image_size),), out / IMAGE_FILE,
            ["pixel_values"], {"pixel_values": {0: "batch"}},
        )
        kw = {}
        if mean is not None:
            kw["mean"] = tuple(mean)
        if std is not None:
            kw["std"] = tuple(std)
        preprocess = ImagePreprocess(size=image_size, **kw)

    return write_export_manifest(
        out, name=name, version=version, embedding_dim=dim, max_tokens=context_length, image_space=image_space,
        text_inputs=["input_ids"], cleaning="clip", image_preprocess=preprocess, source=source, optimize=optimize,
        image_tower=image_tower,
    )


def export_open_clip(
    model_name: str,
    out_dir: str | Path,
    *,
    pretrained: str | None = None,
    model_config: str | Path | None = None,
    name: str | None = None,
    version: str = "1",
    image_space: str | None = None,
    include_image: bool = True,
    optimize: bool = True,
) -> BundleManifest:
    model, cfg = load_open_clip(model_name, pretrained, model_config)
    if model_config is not None and not model_name:
        model_name = Path(model_config).stem
    text_cfg = cfg.get("text_cfg", {})
    vision_cfg = cfg.get("vision_cfg", {})
    image_size = vision_cfg.get("image_size", 224)
    image_size = image_size[0] if isinstance(image_size, (list, tuple)) else image_size
    pp = getattr(model.visual, "preprocess_cfg", None) or {}
    return export_open_clip_model(
        model,
        out_dir,
        name=name or f"open_clip-{model_name}",
        version=version,
        image_space=image_space or open_clip_image_space(model_name, pretrained),
        context_length=text_cfg.get("context_length", 77),
        image_size=int(image_size),
        mean=pp.get("mean"),
        std=pp.get("std"),
        include_image=include_image,
        optimize=optimize,
        source={
            "exporter": "open_clip",
            "model_name": model_name,
            "pretrained": pretrained,
            "model_config": json.loads(Path(model_config).read_text()) if model_config else None,
        },
    )
