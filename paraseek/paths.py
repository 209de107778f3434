"""Default locations of the embedded default's bundle and snapshot (PARASEEK_HOME)."""

from __future__ import annotations

import os
from pathlib import Path


def home() -> Path:
    """PARASEEK_HOME, default ~/.cache/paraseek."""
    return Path(os.environ.get("PARASEEK_HOME", Path.home() / ".cache" / "paraseek"))


def default_bundle() -> Path:
    return home() / "bundles" / "starter"


def default_snapshot() -> Path:
    return home() / "snapshots" / "demo"
