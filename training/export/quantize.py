"""int8 dynamic quantisation of a bundle's text tower, with its agreement to fp32 reported."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Sequence

import numpy as np

from core.bundle import QuantizedSpec, read_manifest, write_manifest
from core.encoder import Encoder

log = logging.getLogger(__name__)
INT8_FILE = "text.int8.onnx"


def quantize_text_tower(bundle_dir: str | Path, calibration_texts: Sequence[str]) -> QuantizedSpec:
    """Write ``text.int8.onnx`` beside ``text.onnx`` and record it in the manifest.

    Dynamic quantisation: int8 weights for MatMul/Gemm (per output channel), activations quantised on
    the fly, so no calibration data is needed to build it; ``calibration_texts`` only measure the
    cosine agreement with fp32 that goes into the manifest.
    """
    from onnxruntime.quantization import QuantType, quantize_dynamic
    from onnxruntime.quantization.shape_inference import quant_pre_process

    bundle_dir = Path(bundle_dir)
    manifest = read_manifest(bundle_dir)
    fp32 = bundle_dir / manifest.text.file
    pre = bundle_dir / "text.preprocessed.onnx"
    out = bundle_dir / INT8_FILE
    try:
        quant_pre_process(str(fp32), str(pre), skip_symbolic_shape=True)
        source = pre
    except Exception as exc:  # pre-processing only helps; quantise the raw graph if it fails
        log.warning("quantisation pre-processing skipped: %s", exc)
        source = fp32
    quantize_dynamic(
        str(source), str(out), weight_type=QuantType.QInt8, per_channel=True,
        op_types_to_quantize=["MatMul", "Gemm"],
    )
    pre.unlink(missing_ok=True)

    enc = Encoder(bundle_dir, load_image=False)
    ref = enc.encode_text(calibration_texts)
    got = enc.with_text_model(out).encode_text(calibration_texts)
    cos = np.sum(ref * got, axis=1)
    spec = QuantizedSpec(
        file=INT8_FILE,
        input_names=manifest.text.input_names,
        output_name=manifest.text.output_name,
        cosine_vs_fp32_mean=float(cos.mean()),
        cosine_vs_fp32_min=float(cos.min()),
    )
    write_manifest(bundle_dir, manifest.model_copy(update={"text_int8": spec}))
    log.info("int8 text tower: cosine vs fp32 mean %.4f min %.4f", spec.cosine_vs_fp32_mean, spec.cosine_vs_fp32_min)
    return spec
