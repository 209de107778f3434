"""paraseek training: torch-side code (fine-tuning recipes, exporters to model bundles).

Importing any part of this package first prepares torch/torchvision (see ``training.torch_env``).
Nothing on the serving path (``paraseek``, ``index``, ``service``) imports this package.
"""

from training import torch_env as _torch_env  # noqa: F401  (side effect: torchvision shim)
