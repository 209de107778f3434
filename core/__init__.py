"""paraseek's ground floor: what every other layer shares and what serving needs without torch.

bundle format (``core.bundle``), encoder runtime (``core.encoder``), tokenizer setup
(``core.tokenizer``), file checksums (``core.integrity``), rank metrics (``core.rank_metrics``),
the one settings object (``core.settings``), the user-error base class (``core.errors``) and the
embedded demo gallery (``core.demo``). Needs numpy, onnxruntime, tokenizers, Pillow and pydantic.
"""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("paraseek")
except PackageNotFoundError:  # running from a source tree that was never installed
    __version__ = "0.0.0"
