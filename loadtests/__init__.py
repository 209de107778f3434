"""Benchmarks, sweeps and load scenarios. They read the test data checked out beside the repository by
default (``../shared/data``); the product itself never does."""

from pathlib import Path

DEFAULT_DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data"
