"""Trainable text towers. Each tokenises, encodes (normalised), says which parameters train, keeps a
frozen copy of itself for the anchor term and WiSE-FT, and exports a bundle.

(a) ``OpenClipText``: an open_clip text tower; the image tower stays frozen, so the image_space is
    kept and existing indexes stay valid.
(b) ``AlignmentText``: a frozen Hugging Face encoder + m trainable transformer layers of the same width
    + a projection into a target image space (Cheng et al.).
(c) ``SentenceText``: the starter's text tower (all-MiniLM-L6-v2) fine-tuned in its own image space.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import paraseek.training.torch_env  # noqa: F401  (torchvision shim before torch-side imports)
import numpy as np
import torch
from torch import nn
from tqdm import tqdm

from paraseek.core.bundle import BundleManifest
from paraseek.core.tokenizer import load_tokenizer
from paraseek.training.export.manifest import ship_image_tower
from paraseek.training.export.hf_text import SentenceEncoder, export_text_encoder, load_hf_encoder, max_seq_length, mean_pool


class TextTower(nn.Module):
    image_space: str
    # texts per forward pass of one `encode` call (0: all in one pass, padded to the longest)
    encode_chunk: int = 512

    def tokenize(self, texts: list[str]) -> dict[str, torch.Tensor]:
        raise NotImplementedError

    def _forward(self, texts: list[str]) -> torch.Tensor:
        device = next(self.parameters()).device
        return self(**{k: v.to(device) for k, v in self.tokenize(texts).items()})

    def encode(self, texts: list[str]) -> torch.Tensor:
        """Embeddings of ``texts`` in input order, with gradients where the tower has them. More than
        ``encode_chunk`` texts go through the tower in chunks of similar length, each padded only to its
        own longest text: the towers mask or never attend to padding, so the rows are the same, and a
        training step of ~4,000 captions padded to its longest ran (and kept the activations of) about
        3x the tokens it holds."""
        chunk = self.encode_chunk
        if not chunk or len(texts) <= chunk:
            return self._forward(texts)
        order = sorted(range(len(texts)), key=lambda i: len(texts[i]))
        parts = [self._forward([texts[i] for i in order[start:start + chunk]]) for start in range(0, len(texts), chunk)]
        back = torch.empty(len(texts), dtype=torch.long)
        back[torch.tensor(order)] = torch.arange(len(texts))
        return torch.cat(parts)[back.to(parts[0].device)]

    @torch.no_grad()
    def embed(self, texts: list[str], batch_size: int = 256, desc: str | None = None) -> np.ndarray:
        """Embeddings of many texts as float32 rows in input order, without gradients. Batches take the
        texts in order of length, as the runtime encoder does: a batch pads to its longest text, and
        one long caption among short ones made every row of its batch pay for it (2-3x the time)."""
        order = sorted(range(len(texts)), key=lambda i: len(texts[i]))
        out = np.zeros((len(texts), 0), np.float32)
        starts = range(0, len(texts), batch_size)
        for start in (tqdm(starts, desc=desc, unit="batch") if desc else starts):
            rows = order[start:start + batch_size]
            vectors = self.encode([texts[i] for i in rows]).float().cpu().numpy()
            if out.shape[1] != vectors.shape[1]:
                out = np.zeros((len(texts), vectors.shape[1]), np.float32)
            out[rows] = vectors
        return out

    def keep_token_ids(self, limit: int) -> None:
        """Keep the token ids of up to ``limit`` texts between calls (0: tokenise every call), where this
        tower's tokenizer is slow enough to be worth it."""

    def trainable_state(self) -> dict[str, torch.Tensor]:
        names = {n for n, p in self.named_parameters() if p.requires_grad}
        return {k: v for k, v in self.state_dict().items() if k in names}

    def export(self, out_dir: Path, *, name: str, version: str, source: dict) -> BundleManifest:
        raise NotImplementedError


class _HFTokenizer:
    def __init__(self, tokenizer_file: Path, max_tokens: int):
        self.tok = load_tokenizer(tokenizer_file, max_tokens, pad_id=0)

    def __call__(self, texts):
        enc = self.tok.encode_batch(list(texts))
        return {"input_ids": torch.tensor([e.ids for e in enc]),
                "attention_mask": torch.tensor([e.attention_mask for e in enc])}


class CachedClipTokenizer:
    """open_clip's tokenizer with each text's token ids kept. Its cleaning and BPE run in Python, about
    50 µs a caption: 0.3-0.5 s of a ~1 s ViT-B-32 step on an H200 at batch 1,024. A run tokenises every
    training text once for its anchor targets and meets the same texts again at every step and epoch.
    The ids are kept as bytes (about 200 B a caption with its key, where a tensor each took 735 B), and
    past ``limit`` texts it tokenises without keeping, so a web-scale run's memory stays bounded."""

    LIMIT = 4_000_000

    def __init__(self, tokenizer, limit: int = LIMIT):
        self.tokenizer = tokenizer
        self.limit = limit
        self.ids: dict[str, bytes] = {}

    def __call__(self, texts: list[str]) -> torch.Tensor:
        """Token ids of ``texts``, zero-padded to the longest real sequence among them."""
        known = self.ids
        missing = [t for t in dict.fromkeys(texts) if t not in known]
        fresh: dict[str, bytes] = {}
        if missing:
            ids = self.tokenizer(missing).numpy().astype(np.int32)
            # a row ends at its last non-zero id: 0 pads, but is also a token ("!" inside "!#$")
            ends = ids.shape[1] - np.argmax(ids[:, ::-1] != 0, axis=1)
            for text, row, n in zip(missing, ids, ends.tolist()):
                fresh[text] = row[:n].tobytes()
            if len(known) + len(fresh) <= self.limit:
                known.update(fresh)
        rows = [np.frombuffer(known[t] if t in known else fresh[t], np.int32) for t in texts]
        out = np.zeros((len(rows), max(map(len, rows), default=0)), np.int64)
        for i, row in enumerate(rows):
            out[i, : len(row)] = row
        return torch.from_numpy(out)


class OpenClipText(TextTower):
    def __init__(self, model_name: str, pretrained: str | None = None, model_config: str | None = None,
                 train_layers: int | None = None):
        super().__init__()
        import open_clip

        # open_clip, lazily: a heavy optional dependency only open_clip towers need
        from paraseek.training.export.openclip import ClipTextTower, load_open_clip, open_clip_image_space

        self.model, cfg = load_open_clip(model_name, pretrained, model_config)
        self.model_name = model_name or Path(model_config or "open_clip").stem
        self.image_space = open_clip_image_space(self.model_name, pretrained)
        self.context_length = cfg.get("text_cfg", {}).get("context_length", 77)
        for p in self.model.parameters():
            p.requires_grad_(False)
        self.tower = ClipTextTower(self.model)  # shares the text modules of self.model
        for p in self.tower.parameters():
            p.requires_grad_(True)
        if train_layers is not None:  # train only the last n residual blocks (+ final LN and projection)
            blocks: list[nn.Module] = list(self.tower.transformer.resblocks)  # type: ignore[arg-type]
            for block in blocks[: len(blocks) - train_layers]:
                for p in block.parameters():
                    p.requires_grad_(False)
            self.tower.token_embedding.weight.requires_grad_(False)
            self.tower.positional_embedding.requires_grad_(False)
        self._tokenizer = CachedClipTokenizer(open_clip.get_tokenizer(self.model_name))
        # a bundle holding this model's frozen image tower (the run's base bundle): exports copy it from there
        self.frozen_image_bundle: Path | None = None

    def tokenize(self, texts):
        # causal tower: running at the longest real length is exact
        return {"input_ids": self._tokenizer(list(texts))}

    def keep_token_ids(self, limit: int) -> None:
        self._tokenizer.limit = limit
        if not limit:
            self._tokenizer.ids.clear()

    def forward(self, input_ids):
        return self.tower(input_ids)

    def export(self, out_dir, *, name, version, source):
        from paraseek.training.export.openclip import export_open_clip_model

        pp = getattr(self.model.visual, "preprocess_cfg", None) or {}
        size: Any = self.model.visual.image_size  # an int or (h, w), typed as a Module attribute
        size = size[0] if isinstance(size, (tuple, list)) else size
        return export_open_clip_model(self.model, out_dir, name=name, version=version, image_space=self.image_space,
                                      context_length=self.context_length, image_size=int(size),
                                      mean=pp.get("mean"), std=pp.get("std"), source=source,
                                      image_from=self.frozen_image_bundle)


class AlignmentHead(nn.Module):
    """m transformer layers over the frozen encoder's token states, mean pooling, projection."""

    def __init__(self, width: int, out_dim: int, layers: int = 6, heads: int = 8, dropout: float = 0.1):
        super().__init__()
        layer = nn.TransformerEncoderLayer(width, heads, 4 * width, dropout=dropout, batch_first=True, norm_first=True)
        self.layers = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(width)
        self.proj = nn.Linear(width, out_dim, bias=False)

    def forward(self, hidden, attention_mask):
        x = self.layers(hidden, src_key_padding_mask=attention_mask == 0)
        return self.proj(self.norm(mean_pool(x, attention_mask)))


class _HFTextTower(TextTower):
    """A tower around a Hugging Face encoder (``SentenceEncoder``): tokenise with its tokenizer.json,
    export as a text bundle that ships the frozen image tower of ``image_bundle``."""

    def __init__(self, encoder: SentenceEncoder, model_dir: Path, image_space: str, image_bundle: Path | None):
        super().__init__()
        self.encoder = encoder
        self.model_dir = model_dir
        self.image_space = image_space
        self.image_bundle = image_bundle
        self.max_tokens = max_seq_length(model_dir)
        self._tokenizer = _HFTokenizer(model_dir / "tokenizer.json", self.max_tokens)

    def tokenize(self, texts):
        return self._tokenizer(texts)

    def forward(self, input_ids, attention_mask):
        return self.encoder(input_ids, attention_mask)

    def export(self, out_dir, *, name, version, source):
        # a text tower tuned against a frozen image tower ships with that same image tower
        image_tower, preprocess = (ship_image_tower(self.image_bundle, out_dir, self.image_space) if self.image_bundle
                                   else (None, None))
        return export_text_encoder(self.encoder.eval(), self.model_dir / "tokenizer.json", out_dir, name=name,
                                   version=version, image_space=self.image_space, max_tokens=self.max_tokens,
                                   source=source, image_preprocess=preprocess, image_tower=image_tower)


class AlignmentText(_HFTextTower):
    def __init__(self, encoder_dir: Path, image_space: str, out_dim: int, layers: int = 6, heads: int = 8,
                 image_bundle: Path | None = None):
        hf, model_dir = load_hf_encoder(encoder_dir)
        for p in hf.parameters():
            p.requires_grad_(False)
        width = int(hf.config.hidden_size)  # type: ignore[arg-type]
        heads = heads if width % heads == 0 else 1
        super().__init__(SentenceEncoder(hf, head=AlignmentHead(width, out_dim, layers, heads)), model_dir,
                         image_space, image_bundle)

    def train(self, mode: bool = True):
        super().train(mode)
        self.encoder.hf_model.eval()  # the frozen encoder never uses dropout
        return self


class SentenceText(_HFTextTower):
    def __init__(self, encoder_dir: Path, image_space: str, image_bundle: Path | None = None,
                 train_layers: int | None = None):
        hf, model_dir = load_hf_encoder(encoder_dir)
        if train_layers is not None:
            for p in hf.parameters():
                p.requires_grad_(False)
            layers: nn.ModuleList = hf.encoder.layer  # type: ignore[assignment]
            for layer in layers[len(layers) - train_layers:]:
                for p in layer.parameters():
                    p.requires_grad_(True)
        super().__init__(SentenceEncoder(hf), model_dir, image_space, image_bundle)


def frozen_copy(tower: TextTower) -> TextTower:
    """The tower as it was before training (anchor term, WiSE-FT)."""
    twin = copy.deepcopy(tower).eval()
    if isinstance(tower, OpenClipText) and isinstance(twin, OpenClipText):
        twin._tokenizer = tower._tokenizer  # one cache of token ids for both: the twin embeds the same texts
    for p in twin.parameters():
        p.requires_grad_(False)
    return twin
