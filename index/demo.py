"""The demo snapshot: the bundled 76-photo COCO gallery (``paraseek.core.demo``) indexed with a bundle.

The starter's vectors of these photos ship beside them (``DEMO_VECTORS``): a first start indexes the
gallery without encoding it (6.5 s of the first answer's wait on 2 cores). They are taken only for the
image tower that made them (``Encoder.image_tower_id``); another bundle's photos are encoded as usual.
``python -m paraseek.index.demo BUNDLE`` writes them anew from a bundle (after a starter release)."""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import numpy as np

from paraseek.core.demo import CAPTIONS_FILE, DEMO_DIR, GALLERY_DIR
from paraseek.core.encoder import Encoder
from paraseek.index.builder import BuildResult, build_snapshot
from paraseek.index.snapshot import Snapshot
from paraseek.index.unchanged_images import DIGEST_FIELD, KnownVectors

DEMO_VECTORS = DEMO_DIR / "vectors.npz"
SHIPPED_ORIGIN = "the demo gallery's shipped vectors"


def shipped_demo_vectors(path: Path = DEMO_VECTORS) -> KnownVectors | None:
    return KnownVectors.load(path, SHIPPED_ORIGIN) if path.is_file() else None


def build_demo_snapshot(encoder: Encoder, root: Path, progress: bool = True, reencode: bool = False) -> BuildResult:
    """``reencode``: every photo encoded into a new version (a rebuild asked for, or a starter upgrade),
    rather than the unchanged ones' vectors reused (the current version's, else the shipped ones where
    ``encoder`` is the tower that made them), or the current version kept when nothing changed."""
    return build_snapshot(CAPTIONS_FILE, encoder, root, image_root=GALLERY_DIR, progress=progress, reuse=not reencode,
                          known=None if reencode else shipped_demo_vectors())


def demo_vectors(encoder: Encoder, root: Path) -> KnownVectors:
    """The gallery's vectors as ``encoder`` makes them: every photo encoded, into a demo snapshot at ``root``."""
    build_demo_snapshot(encoder, root, progress=False, reencode=True)
    snap = Snapshot.load(root, use_gpu=False)
    try:
        by_id = snap.metadata_of(snap.ids)
        rows = [by_id[int(i)] for i in snap.ids]
        vectors = np.asarray(snap.vectors(), np.float32)
    finally:
        snap.close()
    return KnownVectors(SHIPPED_ORIGIN, str(encoder.image_tower_id), np.array([r[DIGEST_FIELD] for r in rows]), vectors,
                        np.array([r["width"] for r in rows]), np.array([r["height"] for r in rows]))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m paraseek.index.demo",
                                     description="Write the demo gallery's vectors as BUNDLE's image tower makes them.")
    parser.add_argument("bundle", type=Path, help="the starter bundle whose image tower the first start builds")
    parser.add_argument("--out", type=Path, default=DEMO_VECTORS)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as scratch:
        demo_vectors(Encoder(args.bundle), Path(scratch)).save(args.out)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
