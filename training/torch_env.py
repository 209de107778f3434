"""The one place that prepares torch/torchvision for import.

torchvision 0.28.0 from the package index is a CUDA build. On the CPU torch wheel this project pins
(torch==2.13.0+cpu), importing it registers fake-tensor kernels for compiled ops
(``torchvision._meta_registrations``) that do not exist in CPU torch, and the import fails with
``RuntimeError: operator torchvision::nms does not exist``. open_clip and timm import torchvision, so
every torch-side module of paraseek imports this module first (``training/__init__.py`` does it).

Putting an empty module under that name before the first torchvision import skips those
registrations. Only meta kernels for torch.compile/fake tensors are lost, which nothing here uses;
on a machine where torchvision's ops load (matching CUDA torch) the shim is not installed.
"""

from __future__ import annotations

import importlib.util
import sys
import types

_META = "torchvision._meta_registrations"


def _torchvision_ops_load() -> bool:
    """True when torchvision's compiled ops are registered with this torch build."""
    import torch

    if "torchvision" in sys.modules:  # already imported (successfully): nothing to do
        return True
    if importlib.util.find_spec("torchvision") is None:
        return True  # not installed: nothing to patch
    if not torch.version.cuda:
        # CPU torch: a CUDA torchvision's ops cannot load; be conservative and shim.
        return False
    return True


def prepare_torch() -> None:
    """Make ``import torchvision`` / ``import open_clip`` work on CPU torch. Idempotent."""
    if _META in sys.modules:
        return
    if not _torchvision_ops_load():
        sys.modules[_META] = types.ModuleType(_META)


prepare_torch()
