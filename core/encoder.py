"""Encoder runtime: load a model bundle with onnxruntime, tokenise, encode text and images.

This is the only module that runs bundle graphs; the index builder, the service, the evaluation
harness, training (to embed images once) and the benchmarks all go through ``Encoder``. It needs
onnxruntime, tokenizers, numpy and Pillow, never torch.
"""

from __future__ import annotations

import functools
import logging
import os
from pathlib import Path
from typing import Iterable, Sequence

import numpy as np

from paraseek.core.bundle import (
    PRECISIONS,
    BundleError,
    BundleManifest,
    ImagePreprocess,
    TowerSpec,
    bundle_digest,
    image_tower_digest,
    read_manifest,
    resolve_precision,
)
from paraseek.core.cpu_threads import openmp_thread_share
from paraseek.core.tokenizer import BundleTokenizer, TokenBatch

log = logging.getLogger(__name__)

# Preferred order; only those onnxruntime reports as available are used.
_PROVIDER_PREFERENCE = ("TensorrtExecutionProvider", "CUDAExecutionProvider", "CPUExecutionProvider")
GPU_PROVIDERS = frozenset({"TensorrtExecutionProvider", "CUDAExecutionProvider"})
_cuda_preloaded = False


def _preload_cuda_libraries() -> None:
    """onnxruntime-gpu installed with its CUDA and cuDNN wheels (the nvidia-* distributions) finds those
    libraries only once they are loaded: ``preload_dlls`` does that, unless a torch of the same CUDA
    was imported first or LD_LIBRARY_PATH already names them."""
    global _cuda_preloaded
    import onnxruntime as ort

    if _cuda_preloaded or not hasattr(ort, "preload_dlls"):
        return
    _cuda_preloaded = True
    try:
        ort.preload_dlls()
    except Exception as exc:  # system-wide CUDA libraries may still be found by the provider itself
        log.warning("onnxruntime could not preload the CUDA libraries: %s", exc)


@functools.lru_cache(maxsize=1)
def _tensorrt_present() -> bool:
    """onnxruntime-gpu lists TensorRT whether or not TensorRT is installed; without its libraries every
    session would first fail on it and be retried on CUDA."""
    import ctypes.util
    import importlib.util

    return ctypes.util.find_library("nvinfer") is not None or any(
        importlib.util.find_spec(name) is not None for name in ("tensorrt_libs", "tensorrt"))


_SHORT_NAMES = {"cpu": "CPUExecutionProvider", "cuda": "CUDAExecutionProvider", "tensorrt": "TensorrtExecutionProvider"}


def provider_names(spec: str | None) -> list[str] | None:
    """``"cuda,cpu"`` (PARASEEK_PROVIDERS) -> onnxruntime's names, in order; full names pass as given."""
    if not spec:
        return None
    return [_SHORT_NAMES.get(name.strip().lower(), name.strip()) for name in spec.split(",") if name.strip()]


def configured_providers(spec: str | None) -> list[str]:
    """The providers a ``PARASEEK_PROVIDERS`` value (``Settings.providers``) places an encoder on: those it
    names, checked against this onnxruntime, else the default order."""
    return choose_providers(provider_names(spec))


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
        chosen = list(requested)
    else:
        chosen = [p for p in _PROVIDER_PREFERENCE if p in available]
        if "TensorrtExecutionProvider" in chosen and not _tensorrt_present():
            chosen.remove("TensorrtExecutionProvider")
    if GPU_PROVIDERS.intersection(chosen):
        _preload_cuda_libraries()
    return chosen


# most image views one run of a multi-view image tower takes (Encoder.encode_pixels)
VIEWS_PER_RUN = 32


def l2_normalize(x: np.ndarray, axis: int = -1) -> np.ndarray:
    norm = np.linalg.norm(x, axis=axis, keepdims=True)
    return x / np.maximum(norm, 1e-12)


def preprocess_image(image, spec: ImagePreprocess) -> np.ndarray:
    """PIL image -> (3, size, size) float32, the same steps as open_clip's/torchvision's transforms;
    (views, 3, size, size) where the spec adds crops: the whole photo, then its crops row by row."""
    image = image.convert("RGB")
    if not spec.crop_grid:
        return _preprocess_view(image, spec)
    w, h = image.size
    cw, ch = max(1.0, w * spec.crop_scale), max(1.0, h * spec.crop_scale)
    # crop origins spread evenly from one edge to the other (a grid of 1: the centre)
    steps = np.linspace(0.0, 1.0, spec.crop_grid) if spec.crop_grid > 1 else np.array([0.5])
    views = [_preprocess_view(image, spec)]
    for fy in steps:
        for fx in steps:
            x, y = fx * (w - cw), fy * (h - ch)
            views.append(_preprocess_view(image.crop((int(x), int(y), int(x + cw), int(y + ch))), spec))
    return np.stack(views)


def _preprocess_view(image, spec: ImagePreprocess) -> np.ndarray:
    from PIL import Image

    resample = Image.Resampling.BICUBIC if spec.interpolation == "bicubic" else Image.Resampling.BILINEAR
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
    x: np.ndarray = np.asarray(image, dtype=np.float32) / 255.0
    x = (x - np.asarray(spec.mean, dtype=np.float32)) / np.asarray(spec.std, dtype=np.float32)
    return np.ascontiguousarray(x.transpose(2, 0, 1))


class Encoder:
    """A loaded model bundle.

    ``precision="int8"`` runs the quantised text tower when the bundle has one. ``threads`` sets
    onnxruntime's intra-op threads (None: ``OMP_NUM_THREADS`` where set, else onnxruntime's default, all cores); ``spin=False`` lets idle
    threads sleep (servers); ``memory_arena=False`` returns activation memory after each call
    (servers, where a rare large batch such as a reindex would otherwise pin its peak).
    ``solo_threads`` adds a second text session with that many threads, for
    ``encode_text(..., solo=True)``: a server whose concurrent calls run single-threaded uses it for a
    call that runs while nothing else does, which then has every core (one caption, int8 starter, 2
    cores: 16.5 -> 10.1 ms). Where ``spin`` is off, that session's threads still spin between the
    operators of a call and stop at its end: a sleeping thread is woken once per operator (ViT-B-32
    int8, one caption: 36.9 -> 33.1 ms; the starter 10.2 -> 8.4), while threads left spinning after
    the call would hold a core for ~50 ms that the search after it needs.
    """

    def __init__(
        self,
        bundle_dir: str | os.PathLike,
        *,
        precision: str = "fp32",
        providers: Sequence[str] | None = None,
        threads: int | None = None,
        solo_threads: int | None = None,
        verify: bool = True,
        load_image: bool = True,
        spin: bool = True,
        memory_arena: bool = True,
    ):
        self.path = Path(bundle_dir)
        self.manifest: BundleManifest = read_manifest(self.path, verify=verify)
        self.digest = bundle_digest(self.manifest)  # what caches key this bundle's vectors by
        self.providers = choose_providers(providers)
        self.threads = threads if threads is not None else openmp_thread_share()
        self.spin = spin
        self.memory_arena = memory_arena
        m = self.manifest
        if precision not in (*PRECISIONS, "auto"):
            raise BundleError(f"precision must be one of {', '.join(PRECISIONS)} or auto, not {precision!r}")
        self.tokenizer = BundleTokenizer(
            self.path / m.tokenizer.file, m.max_tokens, m.tokenizer.cleaning, m.tokenizer.pad_id
        )
        self._load_text_tower(precision)
        if self.on_gpu and not GPU_PROVIDERS.intersection(self.text_providers):
            # the GPU provider did not load (no device visible, libraries missing): run as on a CPU host,
            # where `auto` may choose another tower
            self.providers = ["CPUExecutionProvider"]
            if resolve_precision(m, precision) != self.precision:
                self._load_text_tower(precision)
        self.solo_threads = solo_threads if solo_threads and solo_threads != threads else None
        self._solo_session = self._session(self._text_path, solo=True) if self.solo_threads else None
        self._image_session = None
        self.image_tower_id: str | None = None  # image_tower_digest: which vectors of earlier builds this tower reproduces
        if load_image and m.image is not None:
            self._image_session = self._session(self.path / m.image.file, image=True)
            self.image_tower_id = image_tower_digest(m)

    def _load_text_tower(self, precision: str) -> None:
        m = self.manifest
        precision = resolve_precision(m, precision, gpu=self.on_gpu)
        if precision == "int8" and m.text_int8 is None:
            raise BundleError(f"bundle {self.path} has no int8 text tower (export it with --int8)")
        if precision == "fp16" and m.text_fp16 is None:
            raise BundleError(f"bundle {self.path} has no fp16 text tower (write one with `paraseek models fp16`)")
        self.precision = precision
        text_spec: TowerSpec = {"int8": m.text_int8, "fp16": m.text_fp16}.get(precision) or m.text
        self._text_path = self.path / text_spec.file
        self._text_inputs = list(text_spec.input_names)
        self._text_session = self._session(self._text_path)

    # -- properties -------------------------------------------------------------------------
    @property
    def text_providers(self) -> list[str]:
        """The providers the text session runs on: onnxruntime falls back to CPU where a GPU one fails to load."""
        return list(self._text_session.get_providers())

    @property
    def on_gpu(self) -> bool:
        """Whether the first execution provider is a GPU one (CUDA or TensorRT)."""
        return bool(self.providers) and self.providers[0] in GPU_PROVIDERS

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
    def _session(self, path: Path, solo: bool = False, image: bool = False):
        import onnxruntime as ort

        threads = self.solo_threads if solo else self.threads
        opts = ort.SessionOptions()
        opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        if threads:
            opts.intra_op_num_threads = int(threads)
            opts.inter_op_num_threads = 1
        opts.log_severity_level = 3
        if not self.memory_arena:
            # servers: batch activations are freed after each call instead of kept at their peak
            opts.enable_cpu_mem_arena = False
        if solo and not self.spin:
            # a lone call has the cores to itself: spin between its operators, sleep once it returns
            opts.add_session_config_entry("session.force_spinning_stop", "1")
        elif not self.spin:
            # idle intra-op threads sleep instead of spinning: in a server they would otherwise burn the
            # cores the event loop needs between encoder calls
            opts.add_session_config_entry("session.intra_op.allow_spinning", "0")
        # NCHWc is a layout for convolutions, which text towers have none of; onnxruntime's pass crashes
        # the process on an fp16 graph without fused attention (open_clip's text tower, CPU provider)
        disabled = [] if image else ["NchwcTransformer"]
        session = ort.InferenceSession(str(path), sess_options=opts, providers=self.providers, disabled_optimizers=disabled)
        lost = [p for p in self.providers if p in GPU_PROVIDERS and p not in session.get_providers()]
        if lost:  # onnxruntime falls back to CPU when a provider's libraries fail to load
            log.warning("%s: execution provider(s) %s did not load (CUDA/cuDNN libraries missing?); running on %s",
                        path.name, lost, session.get_providers())
        return session

    def with_text_model(self, onnx_path: str | os.PathLike) -> Encoder:
        """A copy that runs another text graph with this bundle's tokenizer (exporters use it to
        compare a candidate graph, e.g. a quantised one, before it is written into the manifest)."""
        import copy

        other = copy.copy(self)
        other._text_path = Path(onnx_path)
        other._text_session = self._session(other._text_path)
        if self._solo_session is not None:
            other._solo_session = self._session(other._text_path, solo=True)
        return other

    def with_image_model(self, onnx_path: str | os.PathLike) -> Encoder:
        """A copy that runs another image graph (exporters compare a candidate graph with it)."""
        import copy

        other = copy.copy(self)
        other._image_session = self._session(Path(onnx_path), image=True)
        other.image_tower_id = None  # a graph outside the manifest: its vectors match no earlier build's
        return other

    # -- text ---------------------------------------------------------------------------------
    def tokenize(self, texts: Sequence[str]) -> TokenBatch:
        return self.tokenizer(texts)

    @property
    def has_solo_session(self) -> bool:
        return self._solo_session is not None

    def _run_text(self, batch: TokenBatch, solo: bool = False) -> np.ndarray:
        feeds = {"input_ids": batch.input_ids}
        if "attention_mask" in self._text_inputs:
            feeds["attention_mask"] = batch.attention_mask
        session = self._solo_session if solo and self._solo_session is not None else self._text_session
        (out,) = session.run(None, feeds)
        out = out.astype(np.float32, copy=False)
        return l2_normalize(out) if self.manifest.normalize else out

    def encode_text_detailed(
        self, texts: Sequence[str], batch_size: int = 64, *, solo: bool = False
    ) -> tuple[np.ndarray, list[bool]]:
        """Embeddings (N, dim) and, per text, whether it was truncated; ``solo`` runs a single batch on
        the ``solo_threads`` session where there is one.

        Texts are grouped by token length so each batch pads as little as possible, then the rows are
        put back in input order.
        """
        texts = list(texts)
        if not texts:
            return np.zeros((0, self.dim), np.float32), []
        if len(texts) <= batch_size:
            batch = self.tokenize(texts)
            return self._run_text(batch, solo), batch.truncated
        encodings = self.tokenizer.encode(texts)  # once: each run pads its share of them
        order = np.argsort([len(e.ids) for e in encodings], kind="stable")
        out = np.empty((len(texts), self.dim), np.float32)
        truncated = [False] * len(texts)
        for start in range(0, len(texts), batch_size):
            idx = order[start : start + batch_size]
            batch = self.tokenizer.pad([encodings[i] for i in idx])
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
        """Preprocessed pixels (B, 3, H, W), or (B, views, 3, H, W) for a spec with crops -> embeddings (B, dim).

        Photos with several views run a few at a time, at most ``VIEWS_PER_RUN`` views per run: the
        starter's ten views of 32 photos in one run peak near 3 GB, three photos at a time near 0.5 GB."""
        if self._image_session is None:
            raise BundleError(f"bundle {self.path} has no image tower")
        pixels = np.asarray(pixels, np.float32)
        per_run = max(1, VIEWS_PER_RUN // pixels.shape[1]) if pixels.ndim == 5 else len(pixels)
        if len(pixels) <= per_run:
            (out,) = self._image_session.run(None, {"pixel_values": pixels})
        else:
            out = np.concatenate([self._image_session.run(None, {"pixel_values": pixels[i : i + per_run]})[0]
                                  for i in range(0, len(pixels), per_run)])
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
