"""torch module -> ONNX file, and checks of the result against torch."""

from __future__ import annotations

import warnings
from pathlib import Path

import numpy as np
import paraseek.training.torch_env  # noqa: F401  (torchvision shim before torch-side imports)
import torch

OPSET = 18


def export_onnx(
    module: torch.nn.Module,
    example_inputs: tuple[torch.Tensor, ...],
    path: str | Path,
    input_names: list[str],
    dynamic_axes: dict[str, dict[int, str]],
    output_name: str = "embeddings",
    max_sequence: int = 512,
) -> Path:
    """Export ``module`` in eval mode with torch.export (the dynamo exporter) and dynamic axes.

    ``dynamic_axes`` names axes per input ({"input_ids": {0: "batch", 1: "sequence"}}); axes with the
    same name share one symbolic dimension. torch.export keeps every shape symbolic; the older
    TorchScript tracer baked the example's batch and length into nn.MultiheadAttention's reshapes,
    so its graphs failed at other shapes.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    module = module.eval()
    dims: dict[str, torch.export.Dim] = {}
    for axes in dynamic_axes.values():
        for axis_name in axes.values():
            if axis_name not in dims:
                dims[axis_name] = (
                    torch.export.Dim(axis_name, min=2, max=max_sequence)
                    if axis_name == "sequence" else torch.export.Dim(axis_name, min=1, max=1 << 16)
                )
    dynamic_shapes = {name: {axis: dims[n] for axis, n in axes.items()} for name, axes in dynamic_axes.items()}
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        torch.onnx.export(
            module,
            example_inputs,
            str(path),
            input_names=input_names,
            output_names=[output_name],
            dynamic_shapes=dynamic_shapes,
            opset_version=OPSET,
            dynamo=True,
            external_data=False,
            verbose=False,
        )
    _strip_source_locations(path)
    return path


def _strip_source_locations(path: Path) -> None:
    """Drop what the exporter records of the Python source (stack traces with absolute file paths, module
    scopes) from every node: the file's bytes, and the digests that key vectors by them (the image tower id),
    then depend only on the model, not on where paraseek is installed."""
    import onnx

    model = onnx.load(str(path))
    graphs = [model.graph, *(f for f in model.functions)]
    while graphs:
        graph = graphs.pop()
        for node in graph.node:
            node.doc_string = ""
            del node.metadata_props[:]
            graphs.extend(attr.g for attr in node.attribute if attr.HasField("g"))
    onnx.save(model, str(path))


def max_abs_diff(a, b) -> float:
    a = a.detach().cpu().numpy() if isinstance(a, torch.Tensor) else np.asarray(a)
    b = b.detach().cpu().numpy() if isinstance(b, torch.Tensor) else np.asarray(b)
    return float(np.max(np.abs(a - b)))
