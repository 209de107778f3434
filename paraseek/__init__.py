"""paraseek: text-to-image search whose answers stay the same when a user rephrases the query.

This package is the top floor: the ``paraseek`` command line (``paraseek.cli``), which assembles the
commands of the layers below it. The layers, from the ground up: ``core`` (bundle format, encoder
runtime, tokenizer, settings), ``paraphrase`` (paraphrase sources), ``index`` (FAISS snapshots),
``evaluation`` (metrics harness), ``service`` (HTTP) and ``training`` (torch), ``loadtests``.
"""

from core import __version__

__all__ = ["__version__"]
