"""paraseek: text-to-image search whose answers stay the same when a user rephrases the query.

The core package holds what every part shares and what serving needs without torch: the model
bundle format (``paraseek.bundle``), the encoder runtime (``paraseek.encoder``), rank metrics
(``paraseek.metrics``), the demo gallery and the ``paraseek`` CLI.
"""

__version__ = "0.1.0"
