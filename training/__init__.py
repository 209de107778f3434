"""paraseek training: the torch side (fine-tuning recipes, the trainer, exporters to model bundles).

Importing this package imports no torch: ``paraseek.training.cli`` defines the ``models`` and ``train``
commands and imports torch-side modules only inside the commands that need them. Every module that
imports torch imports ``paraseek.training.torch_env`` first (the one torchvision workaround). Nothing on the
serving path (``paraseek.core``, ``paraseek.index``, ``paraseek.service``) imports this package.
"""
