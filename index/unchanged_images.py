"""Reusing the vectors of photos a snapshot already holds, so a reindex encodes only what changed.

A photo's vector depends on its bytes and the image tower (``Encoder.image_tower_id``). A build records
both: the tower's id in the manifest's ``source`` and each file's stamp (size and modification time in
nanoseconds, as ``make`` and ``rsync`` compare files) in its metadata row. The next build of the same
files with the same tower takes the vectors of files whose stamp is unchanged from the current version
and encodes the rest. A file rewritten in place gets a new modification time, so it is encoded again.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np

from paraseek.index.image_sources import ImageRecord
from paraseek.index.store import SearchableSnapshot

STAMP_FIELD = "file_stamp"  # metadata row: [size in bytes, modification time in ns] of the file read
TOWER_FIELD = "image_tower"  # manifest source: the image tower id the version's vectors were made with


def file_stamp(path: str | os.PathLike) -> list[int] | None:
    """[size, mtime_ns] of a file (for a photo inside a tar shard: of the shard), None if it cannot be read.
    Taken before the file is read, so a file changed while it is encoded is stamped older and encoded again."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return [int(st.st_size), int(st.st_mtime_ns)]


def _key(root: str, path: str, member: str | None, offset: int | None) -> tuple[str, str | None, int | None]:
    # a relative path is recorded under the source's root, an update from another folder records absolute
    # ones; not normalised: two spellings of one file (a/./b) only miss, and the file is encoded again
    return path if path.startswith("/") else f"{root}/{path}", member, offset


@dataclass
class Reused:
    """What a build takes from the current version: for the records at ``positions`` (indices into the
    source's records), their vectors and their metadata's size fields."""

    positions: np.ndarray  # int64, ascending
    vectors: np.ndarray  # (len(positions), dim) float32
    sizes: list[dict]  # width, height and file stamp, per reused record

    @classmethod
    def none(cls, dim: int) -> Reused:
        return cls(np.zeros(0, np.int64), np.zeros((0, dim), np.float32), [])


def reusable_vectors(base: SearchableSnapshot, tower_id: str | None, root: Path, records: Sequence[ImageRecord],
                     stamps: Sequence[list[int] | None]) -> Reused:
    """The vectors of ``records`` (read under ``root``, stamped ``stamps``) that ``base`` holds for the same
    file with the same stamp, made by the same image tower. Nothing when ``base`` was made by another
    tower, from precomputed vectors, or before builds recorded stamps."""
    dim = base.manifest.dim
    recorded = base.manifest.source.get(TOWER_FIELD)
    if tower_id is None or recorded != tower_id or not base.image_roots:
        return Reused.none(dim)
    real_root = str(root.resolve())
    wanted = {_key(real_root, r.path, r.member, r.offset): i for i, r in enumerate(records) if stamps[i] is not None}
    base_root = str(base.image_roots[0])
    positions: list[int] = []
    parts: list[np.ndarray] = []
    sizes: dict[int, dict] = {}
    for _ids, vectors, rows in base.iter_contents():
        hits = []  # rows of this chunk whose vector is taken
        for j, row in enumerate(rows):
            stamp = row.get(STAMP_FIELD)
            if stamp is None or not row.get("path"):
                continue
            at = wanted.get(_key(base_root, str(row["path"]), row.get("member"), row.get("offset")))
            if at is not None and at not in sizes and list(stamp) == stamps[at]:
                sizes[at] = {k: row[k] for k in ("width", "height") if k in row} | {STAMP_FIELD: stamps[at]}
                positions.append(at)
                hits.append(j)
        if hits:
            parts.append(np.asarray(vectors[hits], np.float32))  # one gather a chunk, not a copy a row
    if not positions:
        return Reused.none(dim)
    order = np.argsort(positions, kind="stable")
    ordered = np.asarray(positions, np.int64)[order]
    return Reused(ordered, np.concatenate(parts)[order], [sizes[int(p)] for p in ordered])
