"""Half-precision text tower for GPUs, with its agreement to fp32 recorded in the manifest."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Sequence

import numpy as np

from paraseek.core.bundle import HalfSpec, read_manifest, write_manifest
from paraseek.core.encoder import Encoder

log = logging.getLogger(__name__)
FP16_FILE = "text.fp16.onnx"


def half_text_tower(bundle_dir: str | Path, calibration_texts: Sequence[str]) -> HalfSpec:
    """Write ``text.fp16.onnx`` beside ``text.onnx`` and record it in the manifest.

    Weights and activations in fp16, inputs and outputs as the fp32 tower's (token ids in, float32
    embeddings out), so the runtime feeds and reads both the same way. ``calibration_texts`` measure the
    cosine to fp32 that ``auto`` precision reads (on CPU, where onnxruntime computes fp16 operators in
    fp32, that isolates the weight rounding; a GPU computes in fp16 and agrees a little less).
    """
    import onnx
    from onnxruntime.transformers.float16 import convert_float_to_float16

    bundle_dir = Path(bundle_dir)
    manifest = read_manifest(bundle_dir)
    if manifest.text_fp16 is not None:  # converting again: the old file stops being part of the bundle first
        manifest = write_manifest(bundle_dir, manifest.model_copy(update={"text_fp16": None}))
    out = bundle_dir / FP16_FILE
    model = convert_float_to_float16(onnx.load(str(bundle_dir / manifest.text.file)), keep_io_types=True)
    onnx.save(model, str(out))

    enc = Encoder(bundle_dir, precision="fp32", load_image=False, providers=["CPUExecutionProvider"])
    ref = enc.encode_text(calibration_texts)
    got = enc.with_text_model(out).encode_text(calibration_texts)
    cos = np.sum(ref * got, axis=1)
    spec = HalfSpec(file=FP16_FILE, input_names=manifest.text.input_names, output_name=manifest.text.output_name,
                    cosine_vs_fp32_mean=float(cos.mean()), cosine_vs_fp32_min=float(cos.min()))
    write_manifest(bundle_dir, manifest.model_copy(update={"text_fp16": spec}))
    log.info("fp16 text tower: cosine vs fp32 mean %.6f min %.6f; %s", spec.cosine_vs_fp32_mean,
             spec.cosine_vs_fp32_min, spec.qualifies()[1])
    return spec
