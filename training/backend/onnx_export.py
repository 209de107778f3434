"""torch module -> ONNX file, and checks of the result against torch."""

from __future__ import annotations

import warnings
from pathlib import Path

import numpy as np
import torch

OPSET = 17


def export_onnx(
    module: torch.nn.Module,
    example_inputs: tuple[torch.Tensor, ...],
    path: str | Path,
    input_names: list[str],
    dynamic_axes: dict[str, dict[int, str]],
    output_name: str = "embeddings",
) -> Path:
    """Export ``module`` in eval mode with dynamic axes.

    The TorchScript-based exporter is used on purpose: it traces slicing by a dynamic sequence length
    (``positional_embedding[:L]``) into shape ops without needing explicit dynamic-shape constraints,
    and the graph it writes is what onnxruntime's transformer optimiser and quantiser expect.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    module = module.eval()
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore", category=DeprecationWarning)
        warnings.simplefilter("ignore", category=torch.jit.TracerWarning)
        torch.onnx.export(
            module,
            example_inputs,
            str(path),
            input_names=input_names,
            output_names=[output_name],
            dynamic_axes={**dynamic_axes, output_name: {0: "batch"}},
            opset_version=OPSET,
            do_constant_folding=True,
            dynamo=False,
        )
    return path


def max_abs_diff(a, b) -> float:
    a = a.detach().cpu().numpy() if isinstance(a, torch.Tensor) else np.asarray(a)
    b = b.detach().cpu().numpy() if isinstance(b, torch.Tensor) else np.asarray(b)
    return float(np.max(np.abs(a - b)))
