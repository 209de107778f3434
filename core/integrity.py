"""sha256 checksums of the files of a bundle or a snapshot version: computed at write, verified at load."""

from __future__ import annotations

import hashlib
from pathlib import Path

from paraseek.core.errors import UserError


def sha256_file(path: Path, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def checksums(folder: Path, names: list[str] | tuple[str, ...]) -> dict[str, str]:
    return {name: sha256_file(Path(folder) / name) for name in names}


def verify_checksums(folder: Path, expected: dict[str, str], what: str, error: type[UserError]) -> None:
    """Raise ``error`` naming the first file under ``folder`` that is missing or differs from its sha256."""
    folder = Path(folder)
    for name, digest in expected.items():
        path = folder / name
        if not path.is_file():
            raise error(f"{what} {folder}: file {name!r} is missing")
        if sha256_file(path) != digest:
            raise error(f"{what} {folder}: file {name!r} does not match its sha256 (altered or truncated)")
