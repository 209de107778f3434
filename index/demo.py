"""The demo snapshot: the bundled 76-photo COCO gallery (``paraseek.core.demo``) indexed with a bundle."""

from __future__ import annotations

from pathlib import Path

from paraseek.core.demo import CAPTIONS_FILE, GALLERY_DIR
from paraseek.core.encoder import Encoder
from paraseek.index.builder import BuildResult, build_snapshot


def build_demo_snapshot(encoder: Encoder, root: Path, progress: bool = True, reencode: bool = False) -> BuildResult:
    """``reencode``: every photo encoded into a new version (a rebuild asked for, or a starter upgrade),
    rather than the unchanged ones' vectors reused, or the current version kept when nothing changed."""
    return build_snapshot(CAPTIONS_FILE, encoder, root, image_root=GALLERY_DIR, progress=progress, reuse=not reencode)
