"""The starter bundles' names and release version, without torch: a warm start of the embedded default
reads them to tell a starter that an older release built (``training/embedded.py``) without importing
the exporter (``starter.py``)."""

STARTER_NAME = "paraseek-starter"
ROBUST_NAME = "paraseek-starter-robust"
# 2: the image side's softer class mix (top 15 classes at temperature 1.35); 3: the classifier also
# sees 3 x 3 half-size crops of each photo. A new version makes the embedded default rebuild a
# starter built before it, with its demo index and caption bank.
STARTER_VERSION = "3"
# crops per side the image classifier sees beside the whole photo (``paraseek models build-starter --crop-grid``)
CROP_GRID = 3
