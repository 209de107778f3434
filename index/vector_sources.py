"""Precomputed image embeddings as an index source (bring your own vectors).

Layouts read as they are:
- one ``.npy`` file of shape (N, D), with an optional metadata file (``--metadata``, or a file of the
  same stem beside it: ``.parquet``, ``.jsonl``, ``.csv``);
- a folder of ``.npy`` shards, each with a same-stem metadata file beside it (or none);
- clip-retrieval's inference output: ``img_emb/img_emb_{i}.npy`` with ``metadata/metadata_{i}.parquet``.

Metadata rows give each vector its id (column ``id``, ``image_id`` or img2dataset's ``key``; without
one, the running row number) and what the service returns: ``image_path``/``path``, ``url``,
``caption``/``captions``, ``license``/``LICENSE``, and any other column as a user field. Shards are
read one at a time (``np.load(mmap_mode="r")``), so a collection larger than memory can be indexed.
Parquet needs pyarrow (imported only for parquet files).
"""

from __future__ import annotations

import csv
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import numpy as np

from paraseek.core.errors import UserError
from paraseek.index.image_sources import path_id
from paraseek.index.metadata_fields import typed_fields

METADATA_SUFFIXES = (".parquet", ".jsonl", ".csv")
ID_COLUMNS = ("id", "image_id", "key")
NORM_TOLERANCE = 1e-2


class VectorSourceError(UserError):
    """Precomputed vectors or their metadata are missing, malformed or inconsistent; the message names
    the shard and row."""


@dataclass
class VectorShard:
    vectors: Path
    metadata: Path | None
    rows: int
    dim: int
    dtype: str


@dataclass
class VectorSource:
    root: Path
    shards: list[VectorShard]
    kind: str  # "npy" | "shards" | "clip-retrieval"

    @property
    def count(self) -> int:
        return sum(s.rows for s in self.shards)

    @property
    def dim(self) -> int:
        return self.shards[0].dim


def _shard_number(path: Path) -> tuple[int, str]:
    digits = re.findall(r"\d+", path.stem)
    return (int(digits[-1]) if digits else -1, path.name)


def _beside(vectors: Path, folder: Path | None = None, stem: str | None = None) -> Path | None:
    folder = folder or vectors.parent
    stem = stem or vectors.stem
    for suffix in METADATA_SUFFIXES:
        candidate = folder / f"{stem}{suffix}"
        if candidate.is_file():
            return candidate
    return None


def _header(path: Path) -> tuple[int, int, str]:
    try:
        array = np.load(path, mmap_mode="r", allow_pickle=False)
    except (ValueError, OSError) as exc:
        raise VectorSourceError(f"{path}: not a readable .npy array ({exc})") from exc
    if array.ndim != 2:
        raise VectorSourceError(f"{path}: expected a 2-D array (N, D), found shape {array.shape}")
    if array.dtype not in (np.float16, np.float32, np.float64):
        raise VectorSourceError(f"{path}: vectors must be float16/32/64, found {array.dtype}")
    return int(array.shape[0]), int(array.shape[1]), str(array.dtype)


def _shard(vectors: Path, metadata: Path | None) -> VectorShard:
    rows, dim, dtype = _header(vectors)
    return VectorShard(vectors, metadata, rows, dim, dtype)


def open_vector_source(path: str | Path, metadata: str | Path | None = None) -> VectorSource:
    path = Path(path)
    if not path.exists():
        raise VectorSourceError(f"embeddings {path} do not exist")
    if path.is_file():
        if path.suffix != ".npy":
            raise VectorSourceError(f"embeddings {path}: expected a .npy file or a folder of .npy shards")
        meta = Path(metadata) if metadata else _beside(path)
        if meta is not None and not meta.is_file():
            raise VectorSourceError(f"metadata {meta} does not exist")
        source = VectorSource(path.parent, [_shard(path, meta)], "npy")
    elif (path / "img_emb").is_dir():
        files = sorted((path / "img_emb").glob("img_emb_*.npy"), key=_shard_number)
        shards = [_shard(f, _beside(f, path / "metadata", f.stem.replace("img_emb", "metadata"))) for f in files]
        source = VectorSource(path, shards, "clip-retrieval")
    else:
        files = sorted(path.glob("*.npy"), key=_shard_number)
        source = VectorSource(path, [_shard(f, _beside(f)) for f in files], "shards")
    if not source.shards:
        raise VectorSourceError(f"embeddings {path}: no .npy shards found")
    dims = {s.dim for s in source.shards}
    if len(dims) > 1:
        first = source.shards[0]
        odd = next(s for s in source.shards if s.dim != first.dim)
        raise VectorSourceError(f"shard {odd.vectors.name}: dimension {odd.dim}, but {first.vectors.name} has {first.dim}")
    return source


def read_metadata(path: Path) -> list[dict]:
    """Rows of a metadata file: parquet (pyarrow), JSON lines or CSV (header row)."""
    if path.suffix == ".parquet":
        try:
            import pyarrow.parquet as pq  # optional: only parquet metadata needs it
        except ImportError as exc:
            raise VectorSourceError(f"{path}: reading parquet needs pyarrow (pip install pyarrow)") from exc
        return pq.read_table(path).to_pylist()
    if path.suffix == ".jsonl":
        rows = []
        with open(path, encoding="utf-8") as f:
            for number, line in enumerate(f, 1):
                if line.strip():
                    try:
                        rows.append(json.loads(line))
                    except json.JSONDecodeError as exc:
                        raise VectorSourceError(f"{path} line {number}: not JSON ({exc.msg})") from None
        return rows
    if path.suffix == ".csv":
        with open(path, encoding="utf-8", newline="") as f:
            return list(csv.DictReader(f))
    raise VectorSourceError(f"{path}: metadata must be .parquet, .jsonl or .csv")


def _as_id(value, where: str) -> int:
    if isinstance(value, (int, np.integer)) and not isinstance(value, bool):
        return int(value)
    text = str(value).strip()
    if not text:
        raise VectorSourceError(f"{where}: empty id")
    if text.isdigit():
        return int(text)
    return path_id(text)  # a string key: a stable int64 of it


def _json_text(value):
    """Nested values that a flat format (CSV, an export's parquet) carries as JSON text."""
    if isinstance(value, str) and value[:1] in "[{":
        try:
            return json.loads(value)
        except json.JSONDecodeError:
            return value
    return value


def _metadata_row(row: dict, image_id: int, where: str) -> dict:
    """The snapshot's metadata fields from a clip-retrieval / user row, typed (``MetadataFieldError``
    naming ``where`` for a value that cannot be); other columns are kept as they are."""
    out: dict = {"id": image_id}
    rest = {k: v for k, v in row.items() if k not in ID_COLUMNS and v is not None}
    path = rest.pop("image_path", None) or rest.pop("path", None)
    if path:
        out["path"] = path
    url = rest.pop("url", None)
    if url:
        out["url"] = url
    captions = _json_text(rest.pop("captions", None))
    caption = rest.pop("caption", None)
    if captions:
        out["captions"] = captions
    elif caption:
        out["captions"] = [caption]
    license_ = _json_text(rest.pop("license", None) or rest.pop("LICENSE", None))
    if license_:
        out["license"] = license_
    if rest:
        out["fields"] = {k: (v.item() if isinstance(v, np.generic) else v) for k, v in rest.items()}
    return typed_fields(out, where)


def iter_shards(source: VectorSource, normalize: bool = False) -> Iterator[tuple[VectorShard, np.ndarray, np.ndarray, list[dict]]]:
    """(shard, float32 vectors, int64 ids, metadata rows), one shard at a time, every row checked:
    finite, non-zero, unit length (or normalised with ``normalize``), a metadata row per vector."""
    offset = 0
    for shard in source.shards:
        vectors = np.asarray(np.load(shard.vectors, mmap_mode="r"), dtype=np.float32)
        name = shard.vectors.name
        if vectors.shape[1] != source.dim:
            raise VectorSourceError(f"shard {name}: dimension {vectors.shape[1]}, expected {source.dim}")
        finite = np.isfinite(vectors).all(axis=1)
        if not finite.all():
            raise VectorSourceError(f"shard {name} row {int(np.argmin(finite))}: NaN or infinite values")
        norms = np.linalg.norm(vectors, axis=1)
        if (norms == 0).any():
            raise VectorSourceError(f"shard {name} row {int(np.argmax(norms == 0))}: an all-zero vector")
        off = np.abs(norms - 1) > NORM_TOLERANCE
        if off.any():
            if not normalize:
                row = int(np.argmax(off))
                raise VectorSourceError(f"shard {name} row {row}: norm {norms[row]:.4f}, vectors must be L2-normalised "
                                        "(pass --normalize to normalise them)")
        vectors = vectors / norms[:, None]  # exactly unit length, as the index expects
        if shard.metadata is not None:
            rows = read_metadata(shard.metadata)
            if len(rows) != len(vectors):
                raise VectorSourceError(f"shard {name}: {len(vectors)} vectors but {len(rows)} metadata rows in "
                                        f"{shard.metadata.name} (row {min(len(rows), len(vectors))} has no partner)")
            column = next((c for c in ID_COLUMNS if rows and c in rows[0]), None)
            ids = (np.array([_as_id(r.get(column), f"{shard.metadata.name} row {i}") for i, r in enumerate(rows)], np.int64)
                   if column else np.arange(offset, offset + len(rows), dtype=np.int64))
        else:
            rows = [{} for _ in range(len(vectors))]
            ids = np.arange(offset, offset + len(vectors), dtype=np.int64)
        where = shard.metadata.name if shard.metadata is not None else name
        yield shard, vectors, ids, [_metadata_row(r, int(i), f"{where} row {n}") for n, (r, i) in enumerate(zip(rows, ids))]
        offset += len(vectors)
