"""A snapshot's ``metadata.jsonl`` read in place: one JSON row per indexed vector, in the order of
``ids.npy``, looked up by image id without holding the rows in memory.

Parsed into Python dicts, rows cost a few hundred bytes each: gigabytes of private memory at 10M
images, for the ten rows a search returns. Here the file is memory-mapped (page cache, shared by
every process serving the version) and only the start of each line is kept (8 bytes a row).
"""

from __future__ import annotations

import json
import mmap
from collections.abc import Iterator, Mapping
from pathlib import Path

import numpy as np
import orjson

from paraseek.index.faiss_index import IdRows

SCAN_BYTES = 64 << 20  # newline scan window: bounded temporaries whatever the file's size


class MetadataRowError(ValueError):
    """metadata.jsonl disagrees with ids.npy (a row of another id, or another number of rows)."""


def line_starts(buffer) -> np.ndarray:
    """Byte offsets of the lines of ``buffer`` plus one past the end of the last: line i is
    ``buffer[starts[i]:starts[i + 1]]``. A last line without its newline counts."""
    size = len(buffer)
    ends = [np.flatnonzero(np.frombuffer(buffer, np.uint8, count=min(SCAN_BYTES, size - begin), offset=begin) == 10)
            + (begin + 1) for begin in range(0, size, SCAN_BYTES)]
    starts = np.concatenate([np.zeros(1, np.int64), *[e.astype(np.int64) for e in ends]])
    if starts[-1] != size:
        starts = np.append(starts, size)
    return starts


class MetadataFile(Mapping[int, dict]):
    """Image id -> metadata row of one snapshot version (read-only; each lookup parses one line)."""

    def __init__(self, path: str | Path, ids: np.ndarray, id_rows: IdRows | None = None):
        self.path = Path(path)
        self.ids = ids
        self.id_rows = id_rows or IdRows(ids)
        with open(self.path, "rb") as f:
            size = f.seek(0, 2)
            # an empty file cannot be mapped; it has no rows either
            self._buffer: mmap.mmap | bytes = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) if size else b""
        self._starts = line_starts(self._buffer)
        if len(self._starts) - 1 != len(ids):
            raise MetadataRowError(f"{self.path.name} has {len(self._starts) - 1} rows, ids.npy {len(ids)}")

    def row(self, number: int) -> dict:
        """Row ``number`` (ids.npy order), checked to be the row of that id."""
        return self.rows_at(np.asarray([number]))[0]

    def rows_at(self, numbers: np.ndarray) -> list[dict]:
        """Rows ``numbers`` (ids.npy order), each checked to be the row of its id. Offsets and ids are
        gathered in one numpy call each."""
        numbers = np.asarray(numbers, np.int64)
        starts, ends = self._starts[numbers].tolist(), self._starts[numbers + 1].tolist()
        out = []
        for number, start, end, image_id in zip(numbers.tolist(), starts, ends, self.ids[numbers].tolist()):
            line = self._buffer[start:end]
            try:
                row = orjson.loads(line)  # a search's rows: ~0.2-0.5 us each, json's 2
            except orjson.JSONDecodeError:
                row = json.loads(line)  # NaN or Infinity (user fields), which json.dumps writes and orjson refuses
            if not isinstance(row, dict) or row.get("id") != image_id:
                raise MetadataRowError(f"{self.path.name} row {number} is not the row of id {image_id} "
                                       f"(ids.npy row {number}): {str(row)[:80]}")
            out.append(row)
        return out

    def __getitem__(self, image_id: int) -> dict:
        rows, found = self.id_rows.lookup(np.asarray([image_id], np.int64))
        if not found[0]:
            raise KeyError(image_id)
        return self.row(int(rows[0]))

    def __contains__(self, image_id: object) -> bool:
        try:
            return bool(self.id_rows.lookup(np.asarray([image_id], np.int64))[1][0])
        except (TypeError, ValueError, OverflowError):
            return False

    def __iter__(self) -> Iterator[int]:
        return (int(i) for i in self.ids)

    def __len__(self) -> int:
        return len(self.ids)

    def rows(self, begin: int = 0, end: int | None = None, chunk: int = 4096) -> Iterator[dict]:
        """Rows ``begin`` to ``end`` in file order, read front to back."""
        end = len(self.ids) if end is None else min(end, len(self.ids))
        for first in range(begin, end, chunk):
            yield from self.rows_at(np.arange(first, min(first + chunk, end)))

    def values(self) -> Iterator[dict]:  # type: ignore[override]  # a stream, not a view: one pass over the file
        return self.rows()
