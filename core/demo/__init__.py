"""The embedded demo gallery: 76 COCO 2017 photos whose Flickr licence allows redistribution
(CC BY 2.0 / CC BY-SA 2.0, see ATTRIBUTION.md), with their COCO captions."""

from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path

DEMO_DIR = Path(__file__).resolve().parent
GALLERY_DIR = DEMO_DIR / "gallery"
CAPTIONS_FILE = DEMO_DIR / "captions.json"


@lru_cache(maxsize=1)
def demo_captions() -> list[str]:
    """All captions of the demo photos (also used as calibration texts for int8 agreement)."""
    data = json.loads(CAPTIONS_FILE.read_text())
    return [a["caption"].strip() for a in data["annotations"]]
