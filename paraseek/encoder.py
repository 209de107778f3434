"""Encoder runtime: load a model bundle with onnxruntime, tokenise, encode text and images.

This is the only module that runs bundle graphs; the index builder, the service, the evaluation
harness and the benchmarks all go through ``Encoder``. It needs onnxruntime, tokenizers, numpy and
Pillow, never torch.
"""

from __future__ import annotations

import html
import logging
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Sequence

import numpy as np

from paraseek.bundle import BundleError, BundleManifest, ImagePreprocess, read_manifest

log = logging.getLogger(__name__)

# Preferred order; only those onnxruntime reports as available are used.
_PROVIDER_PREFERENCE = ("TensorrtExecutionProvider", "CUDAExecutionProvider", "CPUExecutionProvider")


class EmptyTextError(ValueError):
    """A text is empty or whitespace only: there is nothing to encode."""


def choose_providers(requested: Sequence[str] | None = None) -> list[str]:
    """Execution providers to use: the requested ones, else GPU ones when present, then CPU."""
    import onnxruntime as ort

    available = set(ort.get_available_providers())
    if requested:
        missing = [p for p in requested if p not in available]
        if missing:
            raise BundleError(
                f"execution provider(s) {missing} are not available in this onnxruntime "
                f"(available: {sorted(available)})"
            )
        return list(requested)
    return [p for p in _PROVIDER_PREFERENCE if p in available]


def l2_normalize(x: np.ndarray, axis: int = -1) -> np.ndarray:
    norm = np.linalg.norm(x, axis=axis, keepdims=True)
    return x / np.maximum(norm, 1e-12)


_WHITESPACE = re.compile(r"\s+")


def clip_clean(text: str) -> str:
    """open_clip's text cleaning (basic_clean + whitespace_clean), lowercased."""
    import ftfy

    text = ftfy.fix_text(text)
    text = html.unescape(html.unescape(text))
    return _WHITESPACE.sub(" ", text).strip().lower()


@dataclass
class TokenBatch:
    input_ids: np.ndarray  # (B, L) int64, L = longest real sequence in the batch
    attention_mask: np.ndarray  # (B, L) int64
    truncated: list[bool]  # per text: tokens beyond max_tokens were dropped


class BundleTokenizer:
    """Tokeniser of a bundle: pads each batch only to its longest sequence, truncates to max_tokens."""

    def __init__(self, tokenizer_file: Path, max_tokens: int, cleaning: str, pad_id: int):
        from tokenizers import Tokenizer

        self._tok = Tokenizer.from_file(str(tokenizer_file))
        self._tok.no_padding()
        self._tok.enable_truncation(max_length=max_tokens)
        self.max_tokens = max_tokens
        self.cleaning = cleaning
        self.pad_id = pad_id

    def _prepare(self, text: str, position: int) -> str:
        if not isinstance(text, str):
            raise TypeError(f"text #{position} is {type(text).__name__}, expected str")
        if not text.strip():
            raise EmptyTextError(f"text #{position} is empty or whitespace only")
        if self.cleaning == "clip":
            text = clip_clean(text)
            if not text:
                raise EmptyTextError(f"text #{position} is empty after cleaning")
        return text

    def __call__(self, texts: Sequence[str]) -> TokenBatch:
        prepared = [self._prepare(t, i) for i, t in enumerate(texts)]
        encodings = self._tok.encode_batch(prepared)
        length = max(len(e.ids) for e in encodings)
        ids = np.full((len(encodings), length), self.pad_id, dtype=np.int64)
        mask = np.zeros((len(encodings), length), dtype=np.int64)
        truncated = []
        for row, enc in enumerate(encodings):
            ids[row, : len(enc.ids)] = enc.ids
            mask[row, : len(enc.ids)] = 1
            truncated.append(bool(enc.overflowing))
        if any(truncated):
            log.warning(
                "%d of %d texts exceed %d tokens and were truncated",
                sum(truncated), len(truncated), self.max_tokens,
            )
        return TokenBatch(ids, mask, truncated)

    def is_truncated(self, texts: Sequence[str]) -> list[bool]:
        prepared = [self._prepare(t, i) for i, t in enumerate(texts)]
        return [bool(e.overflowing) for e in self._tok.encode_batch(prepared)]

    def token_counts(self, texts: Sequence[str]) -> list[int]:
        prepared = [self._prepare(t, i) for i, t in enumerate(texts)]
        return [len(e.ids) for e in self._tok.encode_batch(prepared)]


def preprocess_image(image, spec: ImagePreprocess) -> np.ndarray:
    """PIL image -> (3, size, size) float32, the same steps as open_clip's/torchvision's transforms."""
    from PIL import Image

    resample = Image.BICUBIC if spec.interpolation == "bicubic" else Image.BILINEAR
    image = image.convert("RGB")
    size = spec.size
    if spec.resize == "squash":
        image = image.resize((size, size), resample)
    else:
        w, h = image.size
        # torchvision's Resize(int): short side -> size, long side truncated (not rounded)
        if w <= h:
            nw, nh = size, int(size * h / w)
        else:
            nw, nh = int(size * w / h), size
        image = image.resize((nw, nh), resample)
        left = int(round((nw - size) / 2.0))
        top = int(round((nh - size) / 2.0))
        image = image.crop((left, top, left + size, top + size))
    x = np.asarray(image, dtype=np.float32) / 255.0
    x = (x - np.asarray(spec.mean, dtype=np.float32)) / np.asarray(spec.std, dtype=np.float32)
    return np.ascontiguousarray(x.transpose(2, 0, 1))


class Encoder:
    """A loaded model bundle.

    ``precision="int8"`` runs the quantised text tower when the bundle has one. ``threads`` sets
    onnxruntime's intra-op threads (None: onnxruntime's default, all cores); ``spin=False`` lets idle
    threads sleep (servers).
    """

    def __init__(
        self,
        bundle_dir: str | os.PathLike,
        *,
        precision: str = "fp32",
        providers: Sequence[str] | None = None,
        threads: int | None = None,
        verify: bool = True,
        load_image: bool = True,
        spin: bool = True,
    ):
        self.path = Path(bundle_dir)
        self.manifest: BundleManifest = read_manifest(self.path, verify=verify)
        self.providers = choose_providers(providers)
        self.threads = threads
        self.spin = spin
        m = self.manifest
        if precision not in ("fp32", "int8"):
            raise ValueError(f"precision must be 'fp32' or 'int8', not {precision!r}")
        if precision == "int8" and m.text_int8 is None:
            raise BundleError(f"bundle {self.path} has no int8 text tower (export it with --int8)")
        self.precision = precision
        text_spec = m.text_int8 if precision == "int8" else m.text
        self.tokenizer = BundleTokenizer(
            self.path / m.tokenizer.file, m.max_tokens, m.tokenizer.cleaning, m.tokenizer.pad_id
        )
        self._text_session = self._session(self.path / text_spec.file)
        self._text_inputs = list(text_spec.input_names)
        self._image_session = None
        if load_image and m.image is not None:
            self._image_session = self._session(self.path / m.image.file)

    # -- properties -------------------------------------------------------------------------
    @property
    def name(self) -> str:
        return self.manifest.name

    @property
    def version(self) -> str:
        return self.manifest.version

    @property
    def dim(self) -> int:
        return self.manifest.embedding_dim

    @property
    def image_space(self) -> str:
        return self.manifest.image_space

    @property
    def has_image_tower(self) -> bool:
        return self._image_session is not None

    # -- sessions -----------------------------------------------------------------------------
    def _session(self, path: Path):
        import onnxruntime as ort

        opts = ort.SessionOptions()
        opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        if self.threads:
            opts.intra_op_num_threads = int(self.threads)
            opts.inter_op_num_threads = 1
        opts.log_severity_level = 3
        if not self.spin:
            # idle intra-op threads sleep instead of spinning: in a server they would otherwise burn the
            # cores the event loop needs between encoder calls
            opts.add_session_config_entry("session.intra_op.allow_spinning", "0")
        return ort.InferenceSession(str(path), sess_options=opts, providers=self.providers)

    def with_text_model(self, onnx_path: str | os.PathLike) -> "Encoder":
        """A copy that runs another text graph with this bundle's tokenizer (exporters use it to
        compare a candidate graph, e.g. a quantised one, before it is written into the manifest)."""
        import copy

        other = copy.copy(self)
        other._text_session = self._session(Path(onnx_path))
        return other

    # -- text ---------------------------------------------------------------------------------
    def tokenize(self, texts: Sequence[str]) -> TokenBatch:
        return self.tokenizer(texts)

    def _run_text(self, batch: TokenBatch) -> np.ndarray:
        feeds = {"input_ids": batch.input_ids}
        if "attention_mask" in self._text_inputs:
            feeds["attention_mask"] = batch.attention_mask
        (out,) = self._text_session.run(None, feeds)
        out = out.astype(np.float32, copy=False)
        return l2_normalize(out) if self.manifest.normalize else out

    def encode_text_detailed(
        self, texts: Sequence[str], batch_size: int = 64
    ) -> tuple[np.ndarray, list[bool]]:
        """Embeddings (N, dim) and, per text, whether it was truncated.

        Texts are grouped by token length so each batch pads as little as possible, then the rows are
        put back in input order.
        """
        texts = list(texts)
        if not texts:
            return np.zeros((0, self.dim), np.float32), []
        if len(texts) <= batch_size:
            batch = self.tokenize(texts)
            return self._run_text(batch), batch.truncated
        order = np.argsort(self.tokenizer.token_counts(texts), kind="stable")
        out = np.empty((len(texts), self.dim), np.float32)
        truncated = [False] * len(texts)
        for start in range(0, len(texts), batch_size):
            idx = order[start : start + batch_size]
            batch = self.tokenize([texts[i] for i in idx])
            out[idx] = self._run_text(batch)
            for i, t in zip(idx, batch.truncated):
                truncated[i] = t
        return out, truncated

    def encode_text(self, texts: Sequence[str], batch_size: int = 64) -> np.ndarray:
        return self.encode_text_detailed(texts, batch_size)[0]

    # -- images -------------------------------------------------------------------------------
    def preprocess(self, image) -> np.ndarray:
        if self.manifest.image_preprocess is None:
            raise BundleError(f"bundle {self.path} has no image preprocessing spec")
        return preprocess_image(image, self.manifest.image_preprocess)

    def encode_pixels(self, pixels: np.ndarray) -> np.ndarray:
        """Preprocessed pixels (B, 3, H, W) -> embeddings (B, dim)."""
        if self._image_session is None:
            raise BundleError(f"bundle {self.path} has no image tower")
        (out,) = self._image_session.run(None, {"pixel_values": np.asarray(pixels, np.float32)})
        return l2_normalize(out) if self.manifest.normalize else out

    def encode_images(self, images: Iterable, batch_size: int = 32) -> np.ndarray:
        """PIL images -> embeddings (N, dim)."""
        chunks, buf = [], []
        for image in images:
            buf.append(self.preprocess(image))
            if len(buf) == batch_size:
                chunks.append(self.encode_pixels(np.stack(buf)))
                buf = []
        if buf:
            chunks.append(self.encode_pixels(np.stack(buf)))
        if not chunks:
            return np.zeros((0, self.dim), np.float32)
        return np.concatenate(chunks)
