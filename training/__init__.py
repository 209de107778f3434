"""paraseek training: the torch side (fine-tuning recipes, the trainer, exporters to model bundles).

Importing this package imports no torch: ``training.cli`` defines the ``models`` and ``train``
commands and imports torch-side modules only inside the commands that need them. Every module that
imports torch imports ``training.torch_env`` first (the one torchvision workaround). Nothing on the
serving path (``core``, ``index``, ``service``) imports this package.
"""
