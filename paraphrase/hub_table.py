"""Each image's hubness against a caption bank (``CaptionBank.hub_bias``) for a whole index version,
computed once and kept on disk, so that ``hub_weight`` on a large collection costs a lookup a result instead
of a product with the bank for every image a list shows for the first time (about 7 MFLOP an image, and most
of a list's 100 results are new in a large collection: on 100K images, 2 cores, the robust default's p50 went
from 1.34x to 1.14x that of the same expansion without the correction; ``loadtests/research/bench_hubness.py``).

A table is keyed by what its numbers depend on: the index version (its backend, name, creation time and
size) and the bank (the tower that embedded it, its vectors); a file whose key or size does not match is never
read as this version's. A server builds its version's table at start; ``paraseek index build`` and an admin
reindex write it before the version is published, so a large collection serves with it from its first query."""

from __future__ import annotations

import hashlib
import logging
import os
import tempfile
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from paraseek.paraphrase.caption_bank import HUB_TEMPERATURE, CaptionBank

log = logging.getLogger(__name__)

# images per product with the bank: with its chunk of 4,096 captions, a 64 MB score block (a backend's
# chunk of 65,536 images at once would hold 1 GB, twice over)
IMAGES_PER_PRODUCT = 4096
HUB_TABLES_KEPT = 8  # tables under a home: older ones (other versions, banks, towers) are removed past this


@dataclass(frozen=True)
class HubTable:
    ids: np.ndarray  # (N,) int64, ascending
    bias: np.ndarray  # (N,) float32, ``bias[i]`` the hubness of ``ids[i]``

    @classmethod
    def compute(cls, bank: CaptionBank, contents: Iterable[tuple]) -> HubTable:
        """The table of every image in ``contents``: (ids, vectors, ...) chunks, as a snapshot's
        ``iter_contents`` yields them (one chunk in memory at a time)."""
        ids: list[np.ndarray] = []
        bias: list[np.ndarray] = []
        for chunk_ids, vectors, *_ in contents:
            ids.append(np.asarray(chunk_ids, np.int64))
            bias.extend(bank.hub_bias(vectors[at:at + IMAGES_PER_PRODUCT]) for at in range(0, len(vectors), IMAGES_PER_PRODUCT))
        all_ids = np.concatenate(ids) if ids else np.zeros(0, np.int64)
        all_bias = np.concatenate(bias).astype(np.float32) if bias else np.zeros(0, np.float32)
        order = np.argsort(all_ids, kind="stable")
        return cls(all_ids[order], all_bias[order])

    def __len__(self) -> int:
        return len(self.ids)

    def lookup(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(hubness, missing) of an array of ids: 0 where an id is padding (-1) or not in the table;
        ``missing`` marks the real ids the table lacks."""
        ids = np.asarray(ids, np.int64)
        if not len(self.ids):
            return np.zeros(ids.shape, np.float32), ids >= 0
        at = np.clip(np.searchsorted(self.ids, ids), 0, len(self.ids) - 1)
        found = (self.ids[at] == ids) & (ids >= 0)
        return np.where(found, self.bias[at], 0.0).astype(np.float32), (ids >= 0) & ~found

    def save(self, path: Path) -> None:
        """Written whole or not at all (a temporary file renamed), so a reader never sees half a table."""
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as f:
                np.savez(f, ids=self.ids, bias=self.bias)
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise

    @classmethod
    def load(cls, path: Path, count: int) -> HubTable | None:
        """The table at ``path`` if it is there, readable and of ``count`` images; else None (computed again)."""
        try:
            with np.load(path) as f:
                table = cls(np.asarray(f["ids"], np.int64), np.asarray(f["bias"], np.float32))
        except FileNotFoundError:
            return None
        except (OSError, ValueError, KeyError) as exc:
            log.warning("hub table %s is unreadable (%s): computing it again", path, exc)
            return None
        if len(table.ids) != count or len(table.bias) != count or np.any(np.diff(table.ids) <= 0):
            log.warning("hub table %s does not match its index version (%d images): computing it again", path, count)
            return None
        return table


def hub_table_key(version_identity: Iterable[object], bank: CaptionBank) -> str:
    """What a table's numbers depend on, as a file name: the index version, the bank (its manifest names the
    tower that embedded it; its vectors) and the hubness temperature. Not the serving precision: the bank's
    vectors are read from its files, so a table written by ``paraseek index build`` is the server's too."""
    h = hashlib.sha256()
    for part in (*version_identity, bank.manifest.model_dump_json(), HUB_TEMPERATURE):
        h.update(repr(part).encode() + b"\0")
    h.update(np.ascontiguousarray(bank.vectors).tobytes())
    return h.hexdigest()[:32]


def version_identity(manifest) -> tuple:
    """An index version as a hub table's key names it: backend, version, creation time and size (a version
    written again under the same name is another)."""
    return (manifest.backend, manifest.version, manifest.created_at, manifest.count)


def hub_table_path(folder: Path, key: str) -> Path:
    return Path(folder) / f"{key}.npz"


def prune_hub_tables(folder: Path, keep: int = HUB_TABLES_KEPT) -> None:
    """Remove all but the ``keep`` most recently written tables in ``folder``."""
    written = []
    for table in folder.glob("*.npz"):
        try:
            written.append((table.stat().st_mtime, table))
        except FileNotFoundError:  # removed by another process meanwhile
            continue
    for _, old in sorted(written, reverse=True)[keep:]:
        old.unlink(missing_ok=True)


class VersionContents(Protocol):
    """What a table is computed from: a loaded index version (``paraseek.index.store.SearchableSnapshot``)."""

    @property
    def manifest(self) -> Any: ...

    def __len__(self) -> int: ...

    def iter_contents(self) -> Iterable[tuple]: ...


def _version_table_path(folder: Path, snapshot: VersionContents, bank: CaptionBank) -> Path:
    return hub_table_path(folder, hub_table_key(version_identity(snapshot.manifest), bank))


def written_hub_table(folder: Path, snapshot: VersionContents, bank: CaptionBank) -> HubTable | None:
    """The index version's table against ``bank`` where it was written under ``folder``; None, computing nothing,
    where it was not (a rollback swaps at once and leaves the table to the thread after its swap)."""
    return HubTable.load(_version_table_path(folder, snapshot, bank), len(snapshot))


def hub_table_for(folder: Path, snapshot: VersionContents, bank: CaptionBank, *,
                  must_write: bool = False) -> tuple[HubTable, float | None]:
    """The index version's table against ``bank``: read back from ``folder`` (``Settings.hub_tables_dir``)
    where it was written (by a server's start, a reindex or ``paraseek index build``), else computed over the
    whole version and written there. Returns it with the seconds computing took (None when read back). A
    folder that refuses the file is logged and the table returned all the same (computed again at the next
    start); with ``must_write`` (a command whose job is the file) its OSError is raised instead."""
    table = written_hub_table(folder, snapshot, bank)
    if table is not None:
        return table, None
    path = _version_table_path(folder, snapshot, bank)
    began = time.perf_counter()
    table = HubTable.compute(bank, snapshot.iter_contents())
    if len(table) != len(snapshot):
        raise ValueError(f"the version read back {len(table)} images of {len(snapshot)}")
    seconds = time.perf_counter() - began
    log.info("hubness of %d images of index version %s computed in %.1f s", len(table), snapshot.manifest.version, seconds)
    try:
        table.save(path)
        prune_hub_tables(path.parent)
    except OSError as exc:  # a read-only or full disk
        if must_write:
            raise
        log.warning("hub table not written to %s: %s", path, exc)
    return table, seconds
