"""Benchmarks, sweeps and load scenarios. They read the test data checked out beside the repository by
default (``../shared/data``); the product itself never does."""

import atexit
import shutil
import tempfile
from pathlib import Path

DEFAULT_DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data"


def temporary_folder(prefix: str) -> Path:
    """A new folder under the system's temporary directory, removed when the process exits: a benchmark's
    bundles, homes and snapshots run to gigabytes, and a run not given a folder to keep (``--work``,
    ``--home``) leaves nothing behind."""
    path = Path(tempfile.mkdtemp(prefix=prefix))
    atexit.register(shutil.rmtree, path, ignore_errors=True)
    return path
