"""paraseek: text-to-image search whose answers stay the same when a user rephrases the query.

This package is the top floor: the ``paraseek`` command line (``paraseek.cli``), which assembles the
commands of the layers below it. The layers, from the ground up: ``paraseek.core`` (bundle format, encoder
runtime, tokenizer, settings), ``paraseek.paraphrase`` (paraphrase sources), ``paraseek.index`` (FAISS snapshots),
``paraseek.evaluation`` (metrics harness), ``paraseek.service`` (HTTP) and ``paraseek.training`` (torch), ``paraseek.loadtests``.
"""

import os

# Before anything loads OpenMP (faiss does, on import): idle OpenMP threads sleep instead of spinning.
# The service runs the encoder (onnxruntime's own threads) and faiss side by side on the same cores,
# and spinning faiss threads then take the cores the encoder needs: on 2 cores, ViT-B-32 int8 over
# 100K exact, 111-114 requests/s at concurrency 32 with spinning, 140 with PASSIVE. A value the user
# set is kept.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from paraseek.core import __version__  # noqa: E402  (after the environment above)

__all__ = ["__version__"]
