"""Versioned index snapshots: atomic publication, verified loading, search.

Layout of a snapshot root::

    ROOT/current                 text file naming the published version (replaced atomically)
    ROOT/versions/<version>/     index.faiss, ids.npy, vectors.npy, metadata.jsonl, report.json,
                                 manifest.json (sha256 of every file)

A build writes ``versions/.tmp-<version>``, fsyncs it, renames it into place and only then replaces
``current``; an interrupted build leaves ``current`` (and the version it names) untouched.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import threading
import time
from collections import OrderedDict
from contextlib import contextmanager
from pathlib import Path

import faiss
import numpy as np
from filelock import FileLock
from pydantic import ValidationError

from paraseek.core.integrity import checksums, record_verified, verify_checksums
from paraseek.core.memory import available_memory_bytes
from paraseek.index.faiss_index import (
    BLAS_MIN_QUERIES,
    IVF_TYPES,
    SPLIT_SCAN_MIN_ROWS,
    ExactVectors,
    IndexSpec,
    apply_search_params,
    flat_rows,
    id_selector,
    masked_exact_search,
    search,
    search_parameters,
    search_threads,
    set_threads,
    split_scan,
    to_search_device,
)
from paraseek.index.filters import FilterColumns, SearchFilter, user_field_names, widened_ef, widened_nprobe
from paraseek.index.gpu_scan import MAX_K as SCAN_MAX_K
from paraseek.index.gpu_scan import ExactScan, exact_scan_for
from paraseek.index.metadata_file import MetadataFile, MetadataRowError
from paraseek.index.quantized_scan import BYTES_PER_DIMENSION, Codec, QuantizedScan, int8_products_exact
from paraseek.index.quantized_scan import MAX_K as QUANTIZED_MAX_K
from paraseek.index.recall import build_faiss_index, measure_recall
from paraseek.index.store import SearchableSnapshot, SnapshotStore, next_version_name, version_order
from paraseek.index.versions import STALE_BUILD_AFTER_S, SnapshotError, SnapshotManifest, build_is_stale, build_owner, versions_to_prune

CURRENT = "current"
VERSIONS = "versions"
MANIFEST = "manifest.json"
log = logging.getLogger(__name__)
WRITER_LOCK = ".lock"  # see writer_lock
FILES = ("index.faiss", "ids.npy", "vectors.npy", "metadata.jsonl", "report.json")
def new_version_name(root: Path) -> str:
    """The next version name of a snapshot root, counting the versions being written (staging
    folders) as taken. Call it holding ``writer_lock``, and create the staging folder before letting go."""
    versions = root / VERSIONS
    existing = [p.name.removeprefix(STAGING_PREFIX) for p in versions.iterdir()] if versions.is_dir() else []
    return next_version_name(existing)


@contextmanager
def writer_lock(root: Path):
    """Exclusive among the processes writing one snapshot root (an advisory lock on ``root/.lock``): held
    while a version name is taken and its staging folder made, while stale staging folders are removed,
    and while a version is published, activated or pruned; never while a version is built."""
    root.mkdir(parents=True, exist_ok=True)
    # filelock: flock on POSIX, msvcrt's locking on Windows; a new lock object per call, so that two
    # threads of one process exclude each other as two processes do
    with FileLock(root / WRITER_LOCK, is_singleton=False, thread_local=False):
        yield


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


STAGING_PREFIX = ".tmp-"
OWNER = ".owner"  # build_owner() of the process writing a staging folder


def _make_staging(root: Path, version: str) -> Path:
    path = root / VERSIONS / f"{STAGING_PREFIX}{version}"
    (root / VERSIONS).mkdir(parents=True, exist_ok=True)
    path.mkdir()  # FileExistsError rather than take over a folder that another writer owns
    (path / OWNER).write_text(json.dumps(build_owner()))
    return path


def staging_dir(root: Path, version: str) -> Path:
    """Create the staging folder of ``version``, owned by this process (an existing one is an error)."""
    with writer_lock(root):
        return _make_staging(root, version)


def begin_version(root: Path) -> tuple[str, Path]:
    """A new version name of ``root``, reserved: its staging folder exists, owned by this process, so
    no other writer takes the name and no cleaner removes the folder while this process lives."""
    with writer_lock(root):
        version = new_version_name(root)
        return version, _make_staging(root, version)


def clean_stale_staging(root: str | Path, max_age_s: float = STALE_BUILD_AFTER_S) -> list[str]:
    """Remove staging folders a killed build left behind: those whose writer is no longer running on
    this host, and any older than ``max_age_s`` (a writer on another host that never finished).
    A build in progress keeps its folder. Returns the names removed."""
    versions = Path(root) / VERSIONS
    removed: list[str] = []
    if not versions.is_dir():
        return removed
    with writer_lock(Path(root)):  # a folder being created or published is never half-seen here
        for stage in sorted(versions.glob(f"{STAGING_PREFIX}*")):
            try:
                owner = json.loads((stage / OWNER).read_text())
                stale = build_is_stale(owner, started=stage.stat().st_mtime, max_age_s=max_age_s)
            except (OSError, ValueError):
                stale = True  # no readable owner: not written by a live build of this version
            if stale:
                shutil.rmtree(stage, ignore_errors=True)
                removed.append(stage.name)
    return removed


def prune_versions(root: str | Path, keep: int) -> list[str]:
    """Delete the oldest published versions beyond the newest ``keep``; never the current version or
    the one before it (its parent, or the previous version), which a rollback needs."""
    root = Path(root)
    with writer_lock(root):
        versions = sorted((p.name for p in (root / VERSIONS).iterdir() if p.is_dir() and not p.name.startswith(".")),
                          key=version_order)
        current = current_version(root)
        parent = read_snapshot_manifest(root / VERSIONS / current).parent if current in versions else None
        removed = versions_to_prune(versions, current, parent, keep)
        for name in removed:
            shutil.rmtree(root / VERSIONS / name, ignore_errors=True)
    return removed


def write_snapshot_files(
    stage: Path, index: faiss.Index, ids: np.ndarray, vectors: np.ndarray, metadata: list[dict], report: dict
) -> None:
    faiss.write_index(index, str(stage / "index.faiss"))
    np.save(stage / "ids.npy", ids.astype(np.int64))
    np.save(stage / "vectors.npy", vectors.astype(np.float32))
    with open(stage / "metadata.jsonl", "w") as f:
        for row in metadata:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
    (stage / "report.json").write_text(json.dumps(report, indent=2))


def publish(root: Path, stage: Path, manifest: SnapshotManifest, activate: bool = True) -> tuple[Path, SnapshotManifest]:
    """Checksum, fsync and rename the staged version into place, then (``activate``) point
    ``current`` at it."""
    files = checksums(stage, FILES)
    record_verified(stage, files)  # the first load hashes only what changed since (core.integrity)
    manifest = manifest.model_copy(update={"files": files})
    (stage / MANIFEST).write_text(manifest.model_dump_json(indent=2))
    for name in (*FILES, MANIFEST):
        with open(stage / name, "rb") as f:
            os.fsync(f.fileno())
    final = root / VERSIONS / manifest.version
    with writer_lock(root):
        os.rename(stage, final)  # the owner file goes only once the folder is no longer a staging one
        (final / OWNER).unlink(missing_ok=True)
        _fsync_dir(root / VERSIONS)
        if activate:
            _point_current(root, manifest.version)
    return final, manifest


def activate_version(root: Path, version: str) -> None:
    """Atomically point ``current`` at an existing version (write, fsync, rename)."""
    root = Path(root)
    with writer_lock(root):
        _point_current(root, version)


def _point_current(root: Path, version: str) -> None:
    if not (root / VERSIONS / version / MANIFEST).is_file():
        raise SnapshotError(f"cannot activate {version!r}: no such version in {root}")
    tmp = root / f"{CURRENT}.tmp-{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(version + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, root / CURRENT)
    _fsync_dir(root)


def current_version(root: str | Path) -> str | None:
    path = Path(root) / CURRENT
    return path.read_text().strip() if path.is_file() else None


def resolve(path: str | Path) -> Path:
    """A snapshot root (follows ``current``) or a version directory -> the version directory."""
    path = Path(path)
    if (path / MANIFEST).is_file():
        return path
    version = current_version(path)
    if version is None:
        raise SnapshotError(f"{path} is neither a snapshot version nor a snapshot root with a '{CURRENT}' file")
    target = path / VERSIONS / version
    if not target.is_dir():
        raise SnapshotError(f"{path}/{CURRENT} names version {version!r}, which does not exist")
    return target


def read_snapshot_manifest(version_dir: Path) -> SnapshotManifest:
    try:
        return SnapshotManifest.model_validate_json((version_dir / MANIFEST).read_text())
    except (OSError, ValidationError) as exc:
        raise SnapshotError(f"snapshot {version_dir}: {MANIFEST} is unreadable or malformed: {exc}") from exc


def padded(scores: np.ndarray, ids: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """(scores, ids) widened to k columns: -inf and -1 where fewer were found."""
    out_scores = np.full((len(scores), k), -np.inf, np.float32)
    out_ids = np.full((len(ids), k), -1, np.int64)
    out_scores[:, :scores.shape[1]], out_ids[:, :ids.shape[1]] = scores, ids
    return out_scores, out_ids


FILTER_CACHE = 64  # compiled filters kept per snapshot (a filter's mask costs one pass over the metadata)
SMALL_MATCH = 50_000  # at most this many matching images: an exact scan of them beats an ANN with a selector


class FilteredSnapshot:
    """A FAISS snapshot restricted to the images matching a filter. Exact top k among them when the
    index is flat or the matches are few (a scan of just those rows); otherwise the ANN index searched
    with an id selector, so the approximate top k is still taken among matching images only, with
    nprobe / efSearch widened for the share of the collection the filter keeps (``filtered_spec``). A
    query the ANN search answers with fewer hits than there are matches is answered by the exact scan."""

    def __init__(self, snapshot: Snapshot, rows: np.ndarray, selector: faiss.IDSelector | None = None):
        """``selector``: of the rows' ids (default: ``id_selector``'s, built on the first ANN search)."""
        self.snapshot = snapshot
        self.rows = rows  # sorted row numbers of the matching images
        self._selector = selector
        self._spec: IndexSpec | None = None  # filtered_spec, taken once with the selector
        self._selector_lock = threading.Lock()  # searches run in parallel when batching is off

    def __len__(self) -> int:
        return len(self.rows)

    def scans_exactly(self, k: int) -> bool:
        """Whether a top-``k`` search scans the matches rather than searching the ANN index."""
        return self.snapshot.manifest.index.exact or len(self.rows) <= max(SMALL_MATCH, k)

    def search_ids(self, queries: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        snap = self.snapshot
        queries = snap.check_queries(queries)
        spec = snap.manifest.index
        if self.scans_exactly(k):
            copy = snap.scan_copy_for(queries, k)
            if copy is not None and len(self.rows) * 4 > len(snap.ids):
                # a broad filter's exact search reads every row anyway (masked_exact_search): read the copy
                scores, numbers = copy.search(queries, k, search_threads(), among=self.rows)
                return padded(scores, snap.ids[numbers], k)
            return self._scan(queries, k)
        exact = snap.exact_vectors() if (spec.refine_factor or 1) > 1 else None
        width = min(int(k), len(self.rows))
        scores, ids = search(snap.index, spec, queries, width, exact, self.search_params())
        short = np.flatnonzero((ids < 0).any(axis=1))
        if short.size:  # the lists probed or the graph walked held too few matches: scan the matches
            log.debug("%d of %d filtered queries answered short: scanning their %d matches", short.size,
                      len(queries), len(self.rows))
            scores[short], ids[short] = self._scan(queries[short], width)
        return scores, ids

    def _scan(self, queries: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        snap = self.snapshot
        # a flat index's own rows where it has them (the same order as vectors.npy): one file's pages, not two
        vectors = snap._flat if snap._flat is not None else snap.vectors()
        return masked_exact_search(vectors, snap.ids, self.rows, queries, k)

    def filtered_spec(self) -> IndexSpec:
        """The snapshot's search setting widened for the share of the collection the filter keeps."""
        spec = self.snapshot.manifest.index
        share = len(self.rows) / max(1, len(self.snapshot.ids))
        return spec.model_copy(update={"nprobe": widened_nprobe(spec.nprobe, spec.nlist or spec.nprobe, share),
                                       "ef_search": widened_ef(spec.ef_search, share)})

    def search_params(self) -> faiss.SearchParameters:
        """Search parameters for one call, around the id selector and the widened setting, both built once
        on first use. Never shared between calls: faiss' IndexIDMap swaps the selector inside the
        parameters it is given for the duration of a search, so two threads searching with one object
        crash the process."""
        with self._selector_lock:
            if self._selector is None:
                self._selector = id_selector(self.snapshot.ids[self.rows])  # read-only: shared
            if self._spec is None:
                self._spec = self.filtered_spec()
        return search_parameters(self._spec, self._selector)


class Snapshot(SearchableSnapshot):
    """A loaded, verified FAISS snapshot, ready to search."""

    def __init__(self, version_dir: Path, manifest: SnapshotManifest, index, ids: np.ndarray, metadata: MetadataFile,
                 device: str, memory_mapped: bool = False, scan: ExactScan | None = None):
        self.path = version_dir
        self.manifest = manifest
        self.index = index
        self.ids = ids
        self.metadata = metadata
        self.device = device
        self.memory_mapped = memory_mapped  # the index's lists are read from the file's pages, not copied
        self._filters: OrderedDict[str, FilteredSnapshot] = OrderedDict()
        self._columns: FilterColumns | None = None
        self._lock = threading.Lock()
        self._lazy_lock = threading.Lock()  # what is built on first use, by any of the search threads
        self._vectors: np.ndarray | None = None
        self._exact: ExactVectors | None = None
        self._user_fields: list[str] | None = None
        # a view of the flat index's own memory, for scans split among threads (no copy)
        self._flat = flat_rows(index) if manifest.index.exact and device == "cpu" else None
        self._scan = scan  # exact search on a GPU through onnxruntime (``gpu_scan``), where one took the rows
        self._scan_copy: QuantizedScan | None = None  # its searches read it (``prepare_serving``)

    @classmethod
    def load(
        cls,
        path: str | Path,
        *,
        image_space: str | None = None,
        verify: bool = True,
        threads: int | None = None,
        use_gpu: bool | None = None,
        memory_map: bool = True,
        rehash: bool = False,
    ) -> Snapshot:
        """``verify``: the files' sha256s are checked, those verified before and unchanged since (size,
        inode, times: ``core.integrity``) taken as they are unless ``rehash``.
        ``memory_map``: read an IVF index's lists, or a flat index's vectors, from the mapped file
        (read-only) instead of copying them into this process: they cost page cache, which the kernel
        shares between the replicas on a host and can drop, rather than private memory (a 10M x 384
        ivf_pq snapshot: ~1 GB of codes; 100K x 384 flat: 147 MB)."""
        version_dir = resolve(path)
        manifest = read_snapshot_manifest(version_dir)
        check_image_space(manifest, image_space)
        if verify:
            started = time.perf_counter()
            hashed = verify_checksums(version_dir, manifest.files, "snapshot", SnapshotError, trust_unchanged=not rehash)
            log.info("snapshot %s: sha256 checked for %s in %.1f s; %d other files unchanged since their last check",
                     version_dir.name, ", ".join(hashed) or "no file", time.perf_counter() - started,
                     len(manifest.files) - len(hashed))
        set_threads(threads)
        mapped = memory_map and (manifest.index.type in IVF_TYPES or manifest.index.exact)
        # IVF: the lists; flat: its vectors (faiss' flat codes), which searches scan whole where no quantized
        # copy serves them (a server makes one, ``prepare_serving``)
        flags = faiss.IO_FLAG_MMAP_IFC if manifest.index.exact else faiss.IO_FLAG_MMAP
        index = faiss.read_index(str(version_dir / "index.faiss"), flags | faiss.IO_FLAG_READ_ONLY if mapped else 0)
        apply_search_params(index, manifest.index)
        index, device = to_search_device(index, manifest.index, use_gpu)
        # a flat index that faiss left on the CPU (no GPU faiss can search on: PyPI's faiss-gpu on a Hopper
        # card) is scanned on the GPU by onnxruntime where it has one; filters and IVF stay with faiss
        scan = exact_scan_for(flat_rows(index) if manifest.index.exact and device == "cpu" else None, use_gpu)
        if scan is not None and scan.on_gpu:
            device = "gpu"
            log.info("snapshot %s: exact search on the GPU through onnxruntime (%s)", version_dir.name, scan.provider)
        # read-only memory map, as the lists and vectors.npy: 8 bytes a vector of page cache, not private memory
        ids = np.load(version_dir / "ids.npy", mmap_mode="r" if mapped else None)
        if index.ntotal != len(ids):
            raise SnapshotError(f"snapshot {version_dir}: index, ids and metadata disagree on the vector count")
        try:
            metadata = MetadataFile(version_dir / "metadata.jsonl", ids)
            if len(ids):  # the rows are read on demand: check the ends line up now
                metadata.row(0), metadata.row(len(ids) - 1)
        except (MetadataRowError, ValueError) as exc:
            raise SnapshotError(f"snapshot {version_dir}: index, ids and metadata disagree: {exc}") from exc
        return cls(version_dir, manifest, index, ids, metadata, device, memory_mapped=mapped and device == "cpu", scan=scan)

    def __len__(self) -> int:
        return len(self.ids)

    def check_queries(self, queries: np.ndarray) -> np.ndarray:
        queries = np.ascontiguousarray(np.atleast_2d(queries), dtype=np.float32)
        if queries.shape[1] != self.manifest.dim:
            raise SnapshotError(f"query dim {queries.shape[1]} != snapshot dim {self.manifest.dim}")
        return queries

    def search_ids(self, queries: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        """(scores, ids), each (Q, k'), k' = min(k, size); padded ids are -1."""
        queries = self.check_queries(queries)
        spec = self.manifest.index
        k = min(int(k), len(self.ids))
        if self._scan is not None and k <= SCAN_MAX_K:
            scores, positions = self._scan.search(queries, k)
            return scores, self.ids[positions]
        parts = search_threads()
        copy = self.scan_copy_for(queries, k)
        if copy is not None:
            scores, numbers = copy.search(queries, k, parts)
            return scores, self.ids[numbers]
        if self._flat is not None and parts > 1 and len(queries) < BLAS_MIN_QUERIES and len(self._flat) >= SPLIT_SCAN_MIN_ROWS:
            scores, numbers = split_scan(self._flat, queries, k, parts)
            return scores, self.ids[numbers]
        # the id -> row map is built on first use, and only indexes that refine need it for searching
        exact = self.exact_vectors() if (spec.refine_factor or 1) > 1 and not spec.exact else None
        return search(self.index, spec, queries, k, exact)

    def scan_copy_for(self, queries: np.ndarray, k: int) -> QuantizedScan | None:
        """The quantized copy where one was made and it serves this search (k within its bound; fp16: a few
        queries)."""
        copy = self._scan_copy
        return copy if copy is not None and len(queries) <= copy.max_queries and k <= QUANTIZED_MAX_K else None

    def prepare_serving(self, *, scan_copy: Codec | None = "int8", threads: int | None = None) -> None:
        """A quantized copy of a flat collection on the CPU (``index.quantized_scan``) for its searches (fp16:
        of fewer than ``BLAS_MIN_QUERIES`` queries; also where int8 is asked for on a CPU whose int8 product is
        not exact); not for collections small enough to stay cached, nor where the copy would take more than a
        quarter of the memory available."""
        rows = self._flat
        if not scan_copy or rows is None or len(rows) < SPLIT_SCAN_MIN_ROWS or self._scan_copy is not None:
            return
        if scan_copy == "int8" and not int8_products_exact():
            log.warning("snapshot %s: an fp16 copy to search, not int8: onnxruntime's int8 product is not exact on "
                        "this CPU (no VNNI)", self.path.name)
            scan_copy = "fp16"
        size = rows.size * BYTES_PER_DIMENSION[scan_copy]
        if size > available_memory_bytes() / 4:
            log.warning("snapshot %s: no %s copy to search (%.0f MB, more than a quarter of "
                        "the memory available); searches scan the fp32 rows", self.path.name, scan_copy, size / 2**20)
            return
        started = time.perf_counter()
        try:
            self._scan_copy = QuantizedScan(rows, scan_copy, threads=threads)
        except ValueError as exc:
            log.warning("snapshot %s: no %s copy to search: %s", self.path.name, scan_copy, exc)
            return
        self.scan_copy_bytes = self._scan_copy.nbytes
        log.info("snapshot %s: %s copy to search, %.0f MB in %.2f s", self.path.name, scan_copy,
                 self.scan_copy_bytes / 2**20, time.perf_counter() - started)

    def filtered(self, flt: SearchFilter) -> FilteredSnapshot:
        key = flt.key()
        with self._lock:
            view = self._filters.get(key)
            if view is not None:
                self._filters.move_to_end(key)
                return view
            if self._columns is None:
                self._columns = FilterColumns(self.ids, self.metadata, self.user_fields)
            view = FilteredSnapshot(self, np.flatnonzero(self._columns.mask(flt)))
            self._filters[key] = view
            if len(self._filters) > FILTER_CACHE:
                self._filters.popitem(last=False)
            return view

    @property
    def user_fields(self) -> list[str]:
        if self.manifest.user_fields is not None:
            return self.manifest.user_fields
        # snapshots written before manifests listed their user fields: read them off the metadata, once
        with self._lazy_lock:
            if self._user_fields is None:
                self._user_fields = sorted(user_field_names(self.metadata.values()))
            return self._user_fields

    def metadata_of(self, image_ids) -> dict[int, dict]:
        ids = np.asarray([int(i) for i in image_ids], np.int64)
        rows, found = self.metadata.id_rows.lookup(ids)
        return dict(zip(ids[found].tolist(), self.metadata.rows_at(rows[found])))

    def vectors(self) -> np.ndarray:
        """The stored vectors, memory-mapped once (filtered scans, refine and updates share the map)."""
        with self._lazy_lock:
            if self._vectors is None:
                self._vectors = np.load(self.path / "vectors.npy", mmap_mode="r")
            return self._vectors

    def exact_vectors(self) -> ExactVectors:
        """The stored vectors by id (memory-mapped: the refine stage and "more like this" read rows)."""
        vectors = self.vectors()
        with self._lazy_lock:
            if self._exact is None:
                self._exact = ExactVectors(vectors, self.metadata.id_rows)
            return self._exact

    def vectors_of(self, image_ids) -> np.ndarray:
        """The stored (exact) vectors of these image ids, in their order."""
        exact = self.exact_vectors()
        return np.asarray(exact.vectors[exact.rows(np.asarray(image_ids, np.int64))], np.float32)

    def held_ids(self) -> np.ndarray:
        return self.ids

    def iter_metadata(self, chunk: int = 65_536):
        for begin in range(0, len(self.ids), chunk):
            yield self.ids[begin:begin + chunk], list(self.metadata.rows(begin, begin + chunk))

    def iter_contents(self, chunk: int = 65_536):
        vectors = self.vectors()
        for begin in range(0, len(self.ids), chunk):
            ids = self.ids[begin:begin + chunk]
            yield ids, np.asarray(vectors[begin:begin + chunk], np.float32), list(self.metadata.rows(begin, begin + chunk))


def check_image_space(manifest: SnapshotManifest, image_space: str | None) -> None:
    if image_space is not None and image_space != manifest.image_space:
        raise SnapshotError(
            f"snapshot {manifest.version} was built in image space {manifest.image_space!r} "
            f"(bundle {manifest.bundle.name} v{manifest.bundle.version}); the query bundle's image "
            f"space is {image_space!r}. Use a bundle aligned to that image space, or reindex with this bundle."
        )


class FaissStore(SnapshotStore):
    """Versions as folders under a snapshot root, ``current`` naming the published one."""

    backend = "faiss"

    def __init__(self, root: Path, memory_map: bool = True):
        self.root = Path(root)
        self.memory_map = memory_map  # Snapshot.load's: IVF lists and flat vectors read from the mapped index file

    def describe(self) -> str:
        return f"snapshot root {self.root}"

    def current_version(self) -> str | None:
        return current_version(self.root)

    def versions(self) -> list[str]:
        folder = self.root / VERSIONS
        return sorted((p.name for p in folder.iterdir() if p.is_dir() and not p.name.startswith(".")),
                      key=version_order) if folder.is_dir() else []

    def manifest(self, version: str | None = None) -> SnapshotManifest:
        return read_snapshot_manifest(resolve(self.root if version is None else self.root / VERSIONS / version))

    def load(self, version: str | None = None, *, image_space: str | None = None, threads: int | None = None,
             verify: bool = True, rehash: bool = False, use_gpu: bool | None = None) -> Snapshot:
        return Snapshot.load(self.root if version is None else self.root / VERSIONS / version, image_space=image_space,
                             threads=threads, verify=verify, memory_map=self.memory_map, rehash=rehash, use_gpu=use_gpu)

    def activate(self, version: str) -> None:
        activate_version(self.root, version)

    def prune(self, keep: int) -> list[str]:
        return prune_versions(self.root, keep)

    def clean_stale(self) -> list[str]:
        return clean_stale_staging(self.root)

    def location(self, version: str) -> str:
        return str(self.root / VERSIONS / version)

    def new_version_name(self) -> str:
        """A reserved name (``begin_version``): ``write_version`` fills its staging folder."""
        return self.begin_version()

    def begin_version(self) -> str:
        return begin_version(self.root)[0]

    def staging(self, version: str) -> Path:
        return self.root / VERSIONS / f"{STAGING_PREFIX}{version}"

    def abort_version(self, version: str) -> None:
        shutil.rmtree(self.root / VERSIONS / f"{STAGING_PREFIX}{version}", ignore_errors=True)

    def write_version(self, draft, ref, spec, *, queries, query_source, index=None, target_recall=None, activate=True,
                      on_progress=None):
        stage = self.staging(draft.version)
        if not stage.is_dir():  # not begun with begin_version
            stage = staging_dir(self.root, draft.version)
        total = len(draft.ids)
        indexed = on_progress or (lambda done, rows: None)
        try:
            if index is None:
                spec, index = build_faiss_index(spec, draft.vectors, draft.ids, on_added=lambda done: indexed(done, total))
            indexed(total, total)
            spec, recall, n_queries, tuning = measure_recall(index, spec, draft.vectors, draft.ids, queries,
                                                             target_recall=target_recall, query_source=query_source)
            indexed(total, total)
            write_snapshot_files(stage, index, draft.ids, draft.vectors, draft.metadata, draft.report)
            manifest = draft.manifest(ref, spec, recall, n_queries, tuning, backend="faiss")
            final, manifest = publish(self.root, stage, manifest, activate=activate)
        except BaseException:
            shutil.rmtree(stage, ignore_errors=True)  # nothing half-written stays behind; current untouched
            raise
        return str(final), manifest
