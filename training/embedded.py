"""The embedded default: the starter bundle and the demo-gallery snapshot under ``PARASEEK_HOME``.

``ensure_embedded_default`` is the one function that builds them. The snapshot needs only the index
layer; the starter bundle is exported from torch weights, so torch is imported only when the bundle
is missing (a machine without torch serves a prebuilt bundle and is told how to build one).
"""

from __future__ import annotations

import logging
from pathlib import Path

from core.encoder import Encoder
from core.errors import UserError
from core.settings import Settings
from index.demo import build_demo_snapshot
from index.snapshot import current_version

log = logging.getLogger(__name__)

STARTER_MISSING = (
    "the starter bundle is missing at {path} and torch is not installed here ({error}). Build it once on a "
    "machine with the training extra (pip install -c constraints.txt 'paraseek[cpu,train]'; "
    "paraseek models build-starter --out {path}) and copy it here, or set PARASEEK_BUNDLE and "
    "PARASEEK_SNAPSHOT to a prebuilt bundle and snapshot."
)


def ensure_embedded_default(settings: Settings, rebuild: bool = False, progress: bool = True) -> tuple[Path, Path]:
    """(bundle dir, snapshot root) of the embedded default, each built if missing (or ``rebuild``)."""
    bundle, snap_root = settings.starter_bundle_dir, settings.snapshot_root
    if rebuild or not (bundle / "manifest.json").is_file():
        try:
            # torch, lazily: only building the starter needs it
            from training.export.starter import build_starter
        except ImportError as exc:
            raise UserError(STARTER_MISSING.format(path=bundle, error=exc)) from exc
        log.warning("building the starter bundle in %s ...", bundle)
        build_starter(bundle)
    if rebuild or current_version(snap_root) is None:
        log.warning("indexing the demo gallery into %s ...", snap_root)
        build_demo_snapshot(Encoder(bundle), snap_root, progress=progress)
    return bundle, snap_root
