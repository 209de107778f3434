"""Reusing the vectors of photos a snapshot already holds, so a reindex encodes only what changed.

A photo's vector depends on its bytes and the image tower (``Encoder.image_tower_id``). A build records
both: the tower's id in the manifest's ``source`` and, in each file's metadata row, its stamp (size and
modification time in nanoseconds, as ``make`` and ``rsync`` compare files) and a digest of its bytes.
The next build of the same files with the same tower takes the vectors of files whose stamp is
unchanged from the current version. The other files of a size some recorded file had are read and
hashed (reading costs far less than decoding and encoding): one whose digest the version recorded
keeps that vector, wherever it lies now (moved, renamed, copied, or touched without a change). So do
the members of a rewritten tar shard (resharded, reordered). The rest are encoded.

A build also records a digest of all it read and how it indexed (``inputs_digest``): when the next
build's digest is the same, nothing changed, and the current version stays as it is.

Stamps miss a file replaced by another of the same size and modification time (a copy that kept the
original's time, a clock set back). ``checksum`` builds trust bytes only, as ``rsync --checksum`` does:
every photo is read and hashed (``source_digests``), a recorded vector is taken only for the same bytes,
and the current version stays only when every photo it holds still has the bytes it recorded, and every
file it could not decode the bytes it had (``skipped_digest``: a repaired file is encoded).
"""

from __future__ import annotations

import hashlib
import json
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, fields
from pathlib import Path
from typing import BinaryIO, Callable, Iterable, Sequence

import numpy as np
from tqdm import tqdm

from paraseek.core.memory import collection_paused
from paraseek.index.image_sources import ImageRecord, ImageSource, open_record
from paraseek.index.store import SearchableSnapshot

STAMP_FIELD = "file_stamp"  # metadata row: [size in bytes, modification time in ns] of the file read
TOWER_FIELD = "image_tower"  # manifest source: the image tower id the version's vectors were made with
DIGEST_FIELD = "file_digest"  # metadata row: blake2b-128 of the photo's bytes (a file's, or a tar member's)
INPUTS_FIELD = "inputs_digest"  # manifest source: inputs_digest of the build that wrote the version
SKIPPED_FIELD = "skipped_digest"  # manifest source: skipped_digest of the files that build could not decode
RECORD_FIELDS = tuple(f.name for f in fields(ImageRecord))


def _hasher():
    return hashlib.blake2b(digest_size=16)


def content_digest(data: bytes) -> str:
    h = _hasher()
    h.update(data)
    return h.hexdigest()


def stream_digest(f: BinaryIO) -> str:
    """``content_digest`` of what ``f`` reads to its end, hashed as it streams past (never held whole)."""
    h = _hasher()
    while chunk := f.read(1 << 20):
        h.update(chunk)
    return h.hexdigest()


def file_digest(path: str | os.PathLike) -> str | None:
    """``content_digest`` of a file's bytes, None if it cannot be read."""
    try:
        with open(path, "rb") as f:
            return stream_digest(f)
    except OSError:
        return None


def record_digest(root: Path, record: ImageRecord) -> str | None:
    """``content_digest`` of a record's bytes (the file's, or its tar member's), None if they cannot be
    read; hashed as they stream past, never held whole."""
    try:
        with open_record(root, record) as f:
            return stream_digest(f)
    except OSError:
        return None


def source_digests(src: ImageSource, workers: int = 4, progress: bool = False, chunk: int = 256,
                   on_progress: Callable[[int, int], None] | None = None) -> list[str | None]:
    """The ``record_digest`` of each of the source's records, in order. A few threads: hashing and reading
    release the GIL, and a network share answers reads in parallel. A task hashes ``chunk`` records: one
    future a record took 1.8 KB each (370 MB for 200,000 files) and most of the time. ``on_progress(done,
    total)`` after each chunk."""
    records = src.records
    digests: list[str | None] = []
    pool = ThreadPoolExecutor(max_workers=workers)
    try:
        with tqdm(total=len(records), desc="hashing", unit="img", disable=not progress) as bar:
            parts = pool.map(lambda start: [record_digest(src.root, r) for r in records[start:start + chunk]],
                             range(0, len(records), chunk))
            for part in parts:
                digests.extend(part)
                bar.update(len(part))
                if on_progress:
                    on_progress(len(digests), len(records))
    finally:  # stopped midway (a cancelled job, ^C): the chunks not begun are dropped, not hashed first
        pool.shutdown(cancel_futures=True)
    return digests


def file_stamp(path: str | os.PathLike) -> list[int] | None:
    """[size, mtime_ns] of a file (for a photo inside a tar shard: of the shard), None if it cannot be read.
    Taken before the file is read, so a file changed while it is encoded is stamped older and encoded again."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return [int(st.st_size), int(st.st_mtime_ns)]


@collection_paused()
def source_stamps(src: ImageSource) -> list[list[int] | None]:
    """The ``file_stamp`` of each of the source's records, in order."""
    root = str(src.root)
    return [file_stamp(os.path.join(root, r.path)) for r in src.records]


def inputs_digest(records: Sequence[ImageRecord], stamps: Sequence[list[int] | None], rejected: Sequence[dict],
                  settings: dict) -> str:
    """A digest of what an image build's version follows from: every record (id, path, captions, licence,
    urls, tar member) with its file's stamp, the files refused before decoding, and ``settings`` (the
    bundle and image tower, the index spec, the recall target, the source, the paraseek version). Two
    builds with one digest write the same version."""
    h = _hasher()
    h.update(json.dumps(settings, sort_keys=True, default=str).encode())
    for record, stamp in zip(records, stamps, strict=True):
        # the fields as they are (dataclasses.astuple deep-copies them: 85 % of the digest's time)
        h.update(json.dumps([[getattr(record, name) for name in RECORD_FIELDS], stamp], default=str).encode())
        h.update(b"\n")  # one line a record: a field's text cannot run into the next record's
    h.update(json.dumps(list(rejected), sort_keys=True, default=str).encode())
    return h.hexdigest()


def _key(root: str, path: str, member: str | None, offset: int | None) -> tuple[str, str | None, int | None]:
    # a relative path is recorded under the source's root, an update from another folder records absolute
    # ones; not normalised: two spellings of one file (a/./b) only miss, and the file is encoded again
    return path if path.startswith("/") else f"{root}/{path}", member, offset


@dataclass
class Reused:
    """What a build takes from the current version: for the records at ``positions`` (indices into the
    source's records), their vectors and their metadata's size fields; ``moved``: how many of them were
    found by their digest under another path."""

    positions: np.ndarray  # int64, ascending
    vectors: np.ndarray  # (len(positions), dim) float32
    sizes: list[dict]  # width, height, file stamp and digest, per reused record
    moved: int = 0

    @classmethod
    def none(cls, dim: int) -> Reused:
        return cls(np.zeros(0, np.int64), np.zeros((0, dim), np.float32), [])


@dataclass(frozen=True)
class KnownVectors:
    """Vectors an image tower made for photos known by their bytes, kept apart from any version: the demo
    gallery's ship with the package, so a first start indexes it without encoding a photo. ``digests[i]``
    (``content_digest``) is the photo whose vector is ``vectors[i]``, ``widths[i]`` x ``heights[i]`` pixels;
    ``origin`` names them in a build's report."""

    origin: str
    tower_id: str
    digests: np.ndarray  # (n,) str
    vectors: np.ndarray  # (n, dim) float32
    widths: np.ndarray  # (n,) int
    heights: np.ndarray  # (n,) int

    def save(self, path: Path) -> None:
        np.savez_compressed(path, tower_id=np.array(self.tower_id), digests=self.digests.astype(str),
                            vectors=self.vectors.astype(np.float32), widths=self.widths, heights=self.heights)

    @classmethod
    def load(cls, path: Path, origin: str) -> KnownVectors:
        with np.load(path) as saved:
            return cls(origin, str(saved["tower_id"]), saved["digests"], saved["vectors"], saved["widths"],
                       saved["heights"])

    def reusable(self, tower_id: str | None, root: Path, records: Sequence[ImageRecord],
                 stamps: Sequence[list[int] | None]) -> Reused:
        """The vectors of the ``records`` (read under ``root``, stamped ``stamps``) whose bytes are known, when
        ``tower_id`` is the tower that made them; every record is read and hashed (a few ms a photo)."""
        dim = self.vectors.shape[1]
        if tower_id != self.tower_id:
            return Reused.none(dim)
        row_of = {str(d): i for i, d in enumerate(self.digests)}
        positions, rows, sizes = [], [], []
        for i, record in enumerate(records):
            digest = record_digest(root, record) if stamps[i] is not None else None
            row = row_of.get(digest) if digest is not None else None
            if row is not None:
                positions.append(i)
                rows.append(row)
                sizes.append({"width": int(self.widths[row]), "height": int(self.heights[row]), STAMP_FIELD: stamps[i],
                              DIGEST_FIELD: digest})  # as a build that decoded the photo records it
        if not positions:
            return Reused.none(dim)
        return Reused(np.asarray(positions, np.int64), self.vectors[rows].astype(np.float32), sizes)


def reusable_vectors(base: SearchableSnapshot, tower_id: str | None, root: Path, records: Sequence[ImageRecord],
                     stamps: Sequence[list[int] | None], digests: Sequence[str | None] | None = None) -> Reused:
    """The vectors of ``records`` (read under ``root``, stamped ``stamps``) that ``base`` holds for the same
    file with the same stamp, or for a file with the same bytes elsewhere, made by the same image tower.
    With ``digests`` (the records' ``record_digest``: a checksum build) the same file must have the same
    bytes instead of the same stamp. Nothing when ``base`` was made by another tower, from precomputed
    vectors, or before builds recorded stamps (digests: before they recorded digests, a moved file is
    encoded again, and a checksum build encodes every photo)."""
    dim = base.manifest.dim
    recorded = base.manifest.source.get(TOWER_FIELD)
    if tower_id is None or recorded != tower_id or not base.image_roots:
        return Reused.none(dim)
    real_root = str(root.resolve())
    wanted = {_key(real_root, r.path, r.member, r.offset): i for i, r in enumerate(records) if stamps[i] is not None}
    base_root = str(base.image_roots[0])
    taken = _VectorsTaken(len(records), dim)
    sizes: dict[int, dict] = {}
    # sizes of the recorded files that have a digest, a chunk's at a time into numpy: 8 bytes a file at
    # most, not a Python int's 30-odd (80 MB for a 10M-photo version)
    size_parts: list[np.ndarray] = []
    for _ids, vectors, rows in base.iter_contents():
        hits = []  # rows of this chunk whose vector is taken
        digested = []
        for j, row in enumerate(rows):
            stamp = row.get(STAMP_FIELD)
            if stamp is None or not row.get("path"):
                continue
            if DIGEST_FIELD in row:  # the photo's size: the file's, or the tar member's (its stamp is the shard's)
                digested.append(int(row.get("size") or 0) if row.get("member") is not None else stamp[0])
            at = wanted.get(_key(base_root, str(row["path"]), row.get("member"), row.get("offset")))
            if at is not None and at not in sizes and (list(stamp) == stamps[at] if digests is None
                                                       else digests[at] is not None and row.get(DIGEST_FIELD) == digests[at]):
                sizes[at] = _size_fields(row, stamps[at])
                hits.append((j, at))
        taken.take(vectors, hits)
        size_parts.append(np.unique(np.asarray(digested, np.int64)))
    known_sizes = np.unique(np.concatenate(size_parts)) if size_parts else np.zeros(0, np.int64)
    moved = _moved_files(base, real_root, records, stamps, sizes, known_sizes, taken, digests)
    if not taken.positions:
        return Reused.none(dim)
    found = np.asarray(taken.positions, np.int64)
    vectors = taken.rows[:len(found)]
    if len(found) > 1 and not (np.diff(found) > 0).all():  # files listed in another order than the version's rows
        order = np.argsort(found, kind="stable")
        found, vectors = found[order], vectors[order]
    return Reused(found, vectors, [sizes[p] for p in found.tolist()], moved)


class _VectorsTaken:
    """The vectors a build takes from a version, gathered from its chunks straight into one array, and the
    source positions they belong to. The array has a row for every record, but rows never written are
    never resident. A million 384-d vectors are 1.5 GB: gathering into parts, concatenating and reordering
    them made three copies (3.3 s of the 9.5 s to find them), this makes one, and a second only when the
    files are listed in another order than the version's rows."""

    def __init__(self, capacity: int, dim: int):
        self.rows = np.empty((capacity, dim), np.float32)
        self.positions: list[int] = []

    def take(self, chunk: np.ndarray, hits: list[tuple[int, int]]) -> None:
        """Rows ``j`` of ``chunk`` for source positions ``at``, for each (j, at) in ``hits``."""
        if not hits:
            return
        start = len(self.positions)
        # mode="clip": the rows are known to exist, and "raise" gathers into a buffer first
        np.take(chunk, [j for j, _ in hits], axis=0, out=self.rows[start:start + len(hits)], mode="clip")
        self.positions.extend(at for _, at in hits)


def _size_fields(row: dict, stamp: list[int] | None) -> dict:
    return {k: row[k] for k in ("width", "height", DIGEST_FIELD) if k in row} | {STAMP_FIELD: stamp}


def _moved_files(base: SearchableSnapshot, root: str, records: Sequence[ImageRecord], stamps: Sequence[list[int] | None],
                 sizes: dict[int, dict], known_sizes: np.ndarray, taken: _VectorsTaken,
                 digests: Sequence[str | None] | None = None) -> int:
    """Second pass: photos (files or tar members) no path matched, of a size some recorded photo had
    (``known_sizes``, sorted), hashed (or their ``digests`` taken) and looked up by digest in ``base``; their
    vectors are added to ``taken``. -> how many."""
    by_digest: dict[str, list[int]] = {}
    root_path = Path(root)
    for i, record in enumerate(records):
        stamp = stamps[i]
        if i in sizes or stamp is None:
            continue
        size = int(record.size or 0) if record.member is not None else stamp[0]
        at = int(np.searchsorted(known_sizes, size))
        if at == len(known_sizes) or known_sizes[at] != size:
            continue
        digest = record_digest(root_path, record) if digests is None else digests[i]
        if digest is not None:
            by_digest.setdefault(digest, []).append(i)  # two copies of one photo share its vector
    if not by_digest:
        return 0
    found = 0
    for _ids, vectors, rows in base.iter_contents():
        hits = []
        for j, row in enumerate(rows):
            for at in by_digest.pop(row.get(DIGEST_FIELD) or "", []):
                sizes[at] = _size_fields(row, stamps[at])
                hits.append((j, at))
        taken.take(vectors, hits)
        found += len(hits)
        if not by_digest:
            break
    return found


def skipped_digest(skipped: Iterable[tuple[str, str | None]]) -> str:
    """One digest of the files a build could not decode: (location, ``record_digest`` or None where the
    bytes could not be read), in any order."""
    return content_digest(json.dumps(sorted(skipped, key=lambda pair: (pair[0], pair[1] or ""))).encode())


def recorded_bytes_unchanged(base: SearchableSnapshot, root: Path, records: Sequence[ImageRecord],
                             digests: Sequence[str | None]) -> bool:
    """Whether every photo ``base`` holds is among ``records`` (read under ``root``) with the bytes it
    recorded (``digests``: the records' ``record_digest``), and the records it could not decode still have
    the bytes they had (``SKIPPED_FIELD``): a checksum build's proof that nothing changed, where equal
    stamps are not taken for it. Rows without a digest, and versions without the skipped files' digest
    (built before either was recorded), prove nothing."""
    if not base.image_roots or SKIPPED_FIELD not in base.manifest.source:
        return False
    real_root, base_root = str(root.resolve()), str(base.image_roots[0])
    keys = [_key(real_root, r.path, r.member, r.offset) for r in records]  # once: the skipped files need them too
    now = {key: d for key, d in zip(keys, digests, strict=True) if d is not None}
    held = set()
    for _ids, rows in base.iter_metadata():
        for row in rows:
            recorded = row.get(DIGEST_FIELD)
            key = _key(base_root, str(row.get("path") or ""), row.get("member"), row.get("offset"))
            if recorded is None or now.get(key) != recorded:
                return False
            held.add(key)
    not_held = [(r.location, d) for r, key, d in zip(records, keys, digests, strict=True) if key not in held]
    return skipped_digest(not_held) == base.manifest.source[SKIPPED_FIELD]
