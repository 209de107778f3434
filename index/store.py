"""Index backends behind one interface: where snapshot versions are kept, published and loaded.

Two implementations:

- ``faiss`` (``paraseek.index.snapshot.FaissStore``, the embedded default): versions are folders under a
  snapshot root; every replica loads the whole index into its own memory.
- ``milvus`` (``paraseek.index.milvus_store.MilvusStore``): one Milvus collection per version, the serving
  version behind a collection alias; the vectors live in Milvus (Milvus Lite in-process for tests and
  small setups, a standalone or distributed server when the collection outgrows one machine).

The service, the CLI and the builder use only what is declared here, so the two behave the same way:
a build writes a new version and publishes it atomically (a failed one never becomes current), a
loaded version (``SearchableSnapshot``) checks the bundle's image space, and searches take a filter.
"""

from __future__ import annotations

import re
import secrets
from abc import ABC, abstractmethod
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Protocol, runtime_checkable

import numpy as np

from paraseek.core.errors import Unavailable
from paraseek.index.image_sources import resolve_within
from paraseek.index.versions import SnapshotError, rollback_version

if TYPE_CHECKING:
    from paraseek.index.faiss_index import IndexSpec
    from paraseek.index.filters import SearchFilter
    from paraseek.index.quantized_scan import Codec
    from paraseek.index.versions import BundleRef, SnapshotManifest, VersionDraft

# v0001-20261122T080000Z-3f9a: a number and a UTC time (sortable), and a random suffix (versions
# named before the suffix have none) so that two writers naming a version in the same second differ
# (four digits at least: v10000 follows v9999)
VERSION_NAME = re.compile(r"^v(\d{4,})-\d{8}T\d{6}Z(?:-[0-9a-f]{4})?$")


def version_order(name: str) -> tuple[int, str]:
    """Sort key of version names, oldest first: by number (v10000 after v9999, which text order would
    put first), then by name; a name of another form sorts before every numbered one."""
    m = VERSION_NAME.match(name)
    return (int(m.group(1)) if m else -1, name)


def next_version_name(existing: Iterable[str]) -> str:
    """The name of a new version after the ``existing`` ones (published or being written): unique
    across processes writing one collection at once, whichever backend."""
    numbers = [int(m.group(1)) for name in existing if (m := VERSION_NAME.match(name))]
    stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
    return f"v{max(numbers, default=0) + 1:04d}-{stamp}-{secrets.token_hex(2)}"


@dataclass
class SearchHit:
    id: int
    score: float
    rank: int
    metadata: dict


class IndexUnavailable(Unavailable):
    """The vector database did not answer (-> 503; the service keeps running and retries; the CLI
    exits 69, not 2: an outage is not the user's mistake)."""


@runtime_checkable
class SearchView(Protocol):
    """What an index search runs on: a snapshot, or a snapshot restricted by a filter. Equal filters
    on one snapshot give the same view object, so the service merges their searches."""

    def search_ids(self, queries: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]: ...


class SearchableSnapshot(ABC):
    """A loaded snapshot version, ready to search; what the service and the CLI hold."""

    manifest: SnapshotManifest
    device: str
    memory_mapped: bool = False  # searched through a memory map of its files rather than copies in this process
    scan_copy_bytes: int = 0  # what ``prepare_serving`` added to this process: a flat collection's quantized copy

    @property
    def version(self) -> str:
        return self.manifest.version

    @property
    def backend(self) -> str:
        return self.manifest.backend

    def __len__(self) -> int:
        return self.manifest.count

    @abstractmethod
    def search_ids(self, queries: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        """(scores, ids), each (Q, k') with k' = min(k, size); padded ids are -1."""

    def prepare_serving(self, *, scan_copy: Codec | None = "int8", threads: int | None = None) -> None:
        """Build what a server searches with beyond the stored files, once, before it serves this version
        (``scan_copy``: the codec of a flat FAISS snapshot's quantized copy, ``index.quantized_scan``, or
        None for none; ``threads``: the int8 copy's, default every core); nothing by default."""
        return None  # backends whose searches run elsewhere (a Milvus server) build nothing here

    @abstractmethod
    def filtered(self, flt: SearchFilter) -> SearchView:
        """A view searching only the images that match ``flt`` (raises ``FilterError`` naming the
        offending part for a filter this snapshot cannot apply)."""

    def view(self, flt: SearchFilter | None) -> SearchView:
        return self if flt is None else self.filtered(flt)

    def search(self, queries: np.ndarray, k: int, flt: SearchFilter | None = None) -> list[list[SearchHit]]:
        """Hits with their metadata, one list per query (the CLI's and evaluation's view of a search)."""
        scores, ids = self.view(flt).search_ids(queries, k)
        rows = self.metadata_of([int(i) for i in ids.ravel() if i >= 0])
        return [[SearchHit(id=int(i), score=float(s), rank=r + 1, metadata=rows[int(i)])
                 for r, (s, i) in enumerate(zip(srow, irow)) if i >= 0]
                for srow, irow in zip(scores, ids)]

    @abstractmethod
    def metadata_of(self, image_ids) -> dict[int, dict]:
        """The metadata rows of these ids (ids not in the snapshot are left out)."""

    @abstractmethod
    def vectors_of(self, image_ids) -> np.ndarray:
        """The stored vectors of these ids, in their order (KeyError for an id not in the snapshot)."""

    def feedback_vectors(self, ids: np.ndarray) -> list[np.ndarray]:
        """The stored vectors of each row of a search's ids (padding left out: rows may differ in
        length, or be empty), for pseudo-relevance feedback."""
        rows = [[int(i) for i in row if i >= 0] for row in np.atleast_2d(ids)]
        return [self.vectors_of(row) if row else np.zeros((0, self.manifest.dim), np.float32) for row in rows]

    @property
    def user_fields(self) -> list[str]:
        return self.manifest.user_fields or []

    @property
    def image_roots(self) -> list[Path]:
        """The folders this version's images may be served from, recorded at build time (the indexed
        folder, the folders an update added from, ``--image-root`` of a vectors build); a version written
        before roots were recorded serves from the folder it indexed alone."""
        source = self.manifest.source
        roots = source.get("image_roots")
        if roots is None:
            roots = [source["root"]] if source.get("root") else []
        return [Path(r) for r in roots]

    def image_path(self, image_id: int) -> Path | None:
        """The file of an indexed image, links resolved (for an image inside a tar shard: the shard, see
        ``image_member``); None when there is none to serve: no path (precomputed vectors without one),
        or one that resolves outside the version's image roots, whatever its metadata says or a link
        planted later points to."""
        row = self.metadata_of([int(image_id)]).get(int(image_id))
        if row is None or not row.get("path"):
            return None
        roots = self.image_roots  # relative paths are recorded under the first
        return resolve_within(roots[0] / str(row["path"]), roots) if roots else None

    def image_member(self, image_id: int) -> tuple[str, int, int] | None:
        """(member name, offset, size) of an image indexed from a webdataset tar shard, else None."""
        row = self.metadata_of([int(image_id)]).get(int(image_id)) or {}
        if row.get("member") is None:
            return None
        return str(row["member"]), int(row["offset"]), int(row["size"])

    def iter_contents(self, chunk: int = 65_536):
        """(ids, vectors, metadata rows) of the whole version, chunk by chunk (updates and exports)."""
        raise NotImplementedError

    def iter_metadata(self, chunk: int = 65_536):
        """(ids, metadata rows) of the whole version, chunk by chunk, its vectors left unread where the backend can."""
        for ids, _vectors, rows in self.iter_contents(chunk):
            yield ids, rows

    def held_ids(self) -> np.ndarray:
        """Every image id of the version (its vectors and metadata left unread where the backend can)."""
        parts = [ids for ids, _rows in self.iter_metadata()]
        return np.concatenate(parts) if parts else np.zeros(0, np.int64)

    def contents(self) -> tuple[np.ndarray, np.ndarray, list[dict]]:
        """(ids, vectors, metadata rows) of the whole version, in memory (updates and copies)."""
        parts = list(self.iter_contents())
        ids = np.concatenate([p[0] for p in parts]) if parts else np.zeros(0, np.int64)
        vectors = np.concatenate([p[1] for p in parts]) if parts else np.zeros((0, self.manifest.dim), np.float32)
        return ids, vectors, [row for p in parts for row in p[2]]

    def close(self) -> None:
        """Release what the snapshot holds open (a database connection); the FAISS one holds none."""
        return None


class SnapshotStore(ABC):
    """Where snapshot versions of one collection are written, published and loaded."""

    backend: str

    @abstractmethod
    def describe(self) -> str:
        """Where, for messages (never a secret)."""

    @abstractmethod
    def current_version(self) -> str | None: ...

    @abstractmethod
    def versions(self) -> list[str]:
        """Published versions, oldest first."""

    @abstractmethod
    def manifest(self, version: str | None = None) -> SnapshotManifest:
        """A published version's manifest (default: the current one)."""

    @abstractmethod
    def load(self, version: str | None = None, *, image_space: str | None = None, threads: int | None = None,
             verify: bool = True, rehash: bool = False, use_gpu: bool | None = None) -> SearchableSnapshot:
        """A published version (default: the current one), refused when built in another image space;
        ``verify``: checked against its checksums (``rehash``: every file hashed again, not only those
        changed since they were last verified); ``use_gpu``: search on a GPU (None: where one is usable;
        backends whose server searches ignore it)."""

    @abstractmethod
    def activate(self, version: str) -> None:
        """Atomically make a published version the current one."""

    @abstractmethod
    def prune(self, keep: int) -> list[str]:
        """Delete published versions beyond the newest ``keep`` (never the current one or its predecessor)."""

    @abstractmethod
    def clean_stale(self) -> list[str]:
        """Remove what builds that died midway left behind; returns what was removed."""

    @abstractmethod
    def write_version(self, draft: VersionDraft, ref: BundleRef, spec: IndexSpec, *, queries: np.ndarray,
                      query_source: str, index: Any = None, target_recall: float | None = None,
                      activate: bool = True, on_progress: Callable[[int, int], None] | None = None,
                      ) -> tuple[str, SnapshotManifest]:
        """Index a draft's vectors, measure recall against exact search, publish the version (and with
        ``activate`` make it current). -> (where the version lives, its manifest). Nothing of a failed
        write stays visible.

        ``on_progress(rows indexed, rows)`` after each chunk added, and again with every row indexed
        before the recall is measured and before the version is published: an exception it raises (a
        cancelled job) fails the write there, so a cancel lands within a chunk or a step."""

    @abstractmethod
    def location(self, version: str) -> str:
        """Where a version lives: its folder (FAISS), its collection (Milvus)."""

    @abstractmethod
    def new_version_name(self) -> str: ...

    @abstractmethod
    def begin_version(self) -> str:
        """Reserve a new version's name and record that a build of it is under way (a FAISS staging
        folder, a Milvus ``building`` row): from here on, a build that dies leaves something that
        ``clean_stale`` recognises, and nothing that can become current."""

    @abstractmethod
    def abort_version(self, version: str) -> None:
        """Remove what a failed build of ``version`` wrote (never a published version)."""

    def published_manifests(self) -> list[SnapshotManifest]:
        """The published versions' manifests, oldest first; a version pruned between the listing and its
        manifest's read (``index prune`` from elsewhere) is left out."""
        manifests = []
        for version in self.versions():
            try:
                manifests.append(self.manifest(version))
            except SnapshotError:
                continue
        return manifests

    def previous_version(self) -> str:
        """The version a rollback returns to (``rollback_version``); SnapshotError where there is none (its
        message names no path: the service returns it)."""
        versions, current = self.versions(), self.current_version()
        if current is None or current not in versions:
            raise SnapshotError("no current version to roll back from")
        found = rollback_version(versions, current, self.manifest(current).parent)
        if found is None:
            raise SnapshotError(f"{current} is the oldest published version: nothing to roll back to")
        return found

    def close(self) -> None:
        """Release connections (the FAISS store holds none)."""
        return None
