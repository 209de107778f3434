"""paraseek's ground floor: what every other layer shares and what serving needs without torch.

bundle format (``paraseek.core.bundle``), encoder runtime (``paraseek.core.encoder``), tokenizer setup
(``paraseek.core.tokenizer``), file checksums (``paraseek.core.integrity``), rank metrics (``paraseek.core.rank_metrics``),
the one settings object (``paraseek.core.settings``), the user-error base class (``paraseek.core.errors``) and the
embedded demo gallery (``paraseek.core.demo``). Needs numpy, onnxruntime, tokenizers, Pillow and pydantic.
"""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("paraseek")
except PackageNotFoundError:  # running from a source tree that was never installed
    __version__ = "0.0.0"
