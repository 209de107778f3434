"""Build and update snapshots: decode images in parallel, encode in batches, index, publish."""

from __future__ import annotations

import itertools
import json
import logging
import os
import shutil
import tempfile
import time
from collections import deque
from concurrent.futures import Executor, Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Iterable, Iterator, Sequence, TypeVar

import faiss
import numpy as np
from tqdm import tqdm

from paraseek.core import __version__
from paraseek.core.encoder import Encoder
from paraseek.core.images import ImageDecodeError, decode_image, image_media_type
from paraseek.core.memory import MemorySampler, collection_paused
from paraseek.index.faiss_index import (
    ADD_CHUNK_ROWS,
    AUTO_TARGET_RECALL,
    IndexSpec,
    add_chunk_rows,
    add_in_chunks,
    create_index,
)
from paraseek.index.image_sources import ImageRecord, ImageSource, open_record, open_source, resolve_within
from paraseek.index.recall import RECALL_QUERIES, measure_recall
from paraseek.index.snapshot import FaissStore, Snapshot, publish
from paraseek.index.store import IndexUnavailable, SearchableSnapshot, SnapshotStore
from paraseek.index.unchanged_images import (
    DIGEST_FIELD,
    INPUTS_FIELD,
    SKIPPED_FIELD,
    STAMP_FIELD,
    TOWER_FIELD,
    KnownVectors,
    Reused,
    content_digest,
    file_stamp,
    inputs_digest,
    recorded_bytes_unchanged,
    reusable_vectors,
    skipped_digest,
    source_digests,
    source_stamps,
    stream_digest,
)
from paraseek.index.vector_sources import VectorSource, iter_shards, open_vector_source
from paraseek.index.versions import BuildError, BundleRef, SnapshotError, SnapshotManifest, VersionDraft

log = logging.getLogger(__name__)
T = TypeVar("T")
R = TypeVar("R")


@dataclass
class BuildResult:
    location: str  # the version folder (faiss) or collection (milvus)
    manifest: SnapshotManifest
    skipped: list[dict] = field(default_factory=list)
    images_per_second: float = 0.0
    report: dict = field(default_factory=dict)

    @property
    def version_dir(self) -> Path:
        """The version's folder (FAISS snapshots)."""
        return Path(self.location)


# a file past this is no photo to index (a video, a disk image): refused from its size, never read whole
MAX_IMAGE_FILE_BYTES = 256 << 20


def _decode(encoder: Encoder, root: Path, record: ImageRecord):
    """-> (pixels, width, height, file fields: stamp and digest) or, for a file that cannot be read or
    decoded, ``{"error": why}`` with the digest of its bytes where they could be read; never raises (bad
    files are reported). What is larger than any photo is refused unread, and what is not an image by its
    header is never held whole: a build's memory does not follow what else a folder holds."""
    stamp = file_stamp(root / record.path)  # before the read: a file changed meanwhile is stamped older
    fields: dict = {STAMP_FIELD: stamp} if stamp else {}
    try:
        # a tar shard's member is read in place; the bytes are hashed on the way (a moved file is found by
        # them, a checksum build compares them: unchanged_images)
        with open_record(root, record) as f:
            size = f.raw.size  # type: ignore[attr-defined]
            if size > MAX_IMAGE_FILE_BYTES:  # never read (no digest: a checksum build proves nothing unchanged with it)
                return {"error": f"{size} bytes, more than an image file may have ({MAX_IMAGE_FILE_BYTES})"}
            if image_media_type(f) is None:  # not read whole: hashed as it streams past, for checksum builds
                f.seek(0)
                return {"error": "not an image (no format Pillow reads starts it)", DIGEST_FIELD: stream_digest(f)}
            f.seek(0)
            source = f.read()
        fields[DIGEST_FIELD] = content_digest(source)
        with decode_image(source) as im:
            width, height = im.size
            return encoder.preprocess(im), width, height, fields
    except ImageDecodeError as exc:
        cause = exc.__cause__
        # its digest: a checksum build keeps the version only while a skipped file keeps its bytes
        return {"error": f"{type(cause).__name__}: {cause}" if cause is not None else str(exc),
                DIGEST_FIELD: fields[DIGEST_FIELD]}
    except OSError as exc:  # the file itself could not be read
        return {"error": f"{type(exc).__name__}: {exc}"}


def decoded_ahead(pool: Executor, fn: Callable[[T], R], items: Iterable[T], window: int) -> Iterator[tuple[T, R]]:
    """(item, fn(item)) in input order, computed on ``pool`` at most ``window`` items ahead of the consumer.

    ``Executor.map`` submits every item at once, so a large collection decoded faster than it is
    encoded would hold every decoded photo in memory (6 MB each with the starter's ten views)."""
    pending: deque[tuple[T, Future[R]]] = deque()
    source = iter(items)
    for item in itertools.islice(source, window):
        pending.append((item, pool.submit(fn, item)))
    while pending:
        item, future = pending.popleft()
        for following in itertools.islice(source, 1):
            pending.append((following, pool.submit(fn, following)))
        yield item, future.result()


BuildProgress = Callable[[str, int, int], None]
"""``(phase, done, total)`` of an image build: "hashing" the photos (``checksum``), "reusing" the vectors of
unchanged ones, "encoding" (reused photos count as done), "indexing" (building, measuring and writing the
version: ``done`` is 0 until it is written)."""


def embed_records(
    encoder: Encoder,
    root: Path,
    records: Sequence[ImageRecord],
    *,
    batch_size: int = 32,
    workers: int | None = None,
    progress: bool = True,
    on_progress: Callable[[int, int], None] | None = None,
) -> tuple[np.ndarray, list[ImageRecord], list[dict], list[dict]]:
    """-> (vectors, kept records, their size info, file stamps and digests, skipped [{path, error}])."""
    workers = workers or min(8, os.cpu_count() or 2)
    vectors: list[np.ndarray] = []
    kept: list[ImageRecord] = []
    sizes: list[dict] = []
    skipped: list[dict] = []
    pending: list[tuple[np.ndarray, ImageRecord]] = []
    bar = tqdm(total=len(records), unit="img", desc="encoding", disable=not progress, smoothing=0.1)

    def flush():
        if pending:
            vectors.append(encoder.encode_pixels(np.stack([p for p, _ in pending])))
            for _, rec in pending:
                kept.append(rec)
            pending.clear()

    with ThreadPoolExecutor(max_workers=workers) as pool:
        decoded = decoded_ahead(pool, lambda r: _decode(encoder, root, r), records, window=2 * batch_size)
        for done, (record, result) in enumerate(decoded, 1):
            if isinstance(result, dict):
                skipped.append({"path": record.location, **result})
                log.warning("skipped %s: %s", record.location, result["error"])
            else:
                pixels, width, height, fields = result
                pending.append((pixels, record))
                sizes.append({"width": width, "height": height} | fields)
                if len(pending) == batch_size:
                    flush()
            bar.update(1)
            if on_progress:
                on_progress(done, len(records))
        flush()
    bar.close()
    matrix = np.concatenate(vectors) if vectors else np.zeros((0, encoder.dim), np.float32)
    return matrix, kept, sizes, skipped


def _merged_in_source_order(records: Sequence[ImageRecord], reused: Reused, vectors: np.ndarray,
                            kept: list[ImageRecord], sizes: list[dict]) -> tuple[np.ndarray, list[ImageRecord], list[dict]]:
    """The reused photos and those just encoded (``kept``, in the source's order), interleaved in the
    source's order. Each side is written once into its rows of one array: a million reused vectors are
    1.5 GB, and concatenating then reordering made two more copies."""
    if not kept:
        return reused.vectors, [records[p] for p in reused.positions.tolist()], reused.sizes
    position = {id(r): i for i, r in enumerate(records)}
    new_positions = np.array([position[id(r)] for r in kept], np.int64)
    both = np.concatenate([reused.positions, new_positions])
    order = np.argsort(both, kind="stable")
    rank = np.empty_like(order)
    rank[order] = np.arange(len(order))  # where each photo lands in the merged order
    merged = np.empty((len(both), reused.vectors.shape[1]), np.float32)
    merged[rank[:len(reused.positions)]] = reused.vectors
    merged[rank[len(reused.positions):]] = vectors
    in_order = [records[p] for p in both[order].tolist()]
    all_sizes = reused.sizes + sizes
    return merged, in_order, [all_sizes[i] for i in order.tolist()]


@collection_paused()
def _metadata(records: Iterable[ImageRecord], sizes: Iterable[dict]) -> list[dict]:
    rows = []
    for rec, size in zip(records, sizes):
        row = {k: v for k, v in asdict(rec).items() if v not in (None, [])}
        row.update(size)
        rows.append(row)
    return rows


def _recall_queries(encoder: Encoder, metadata: list[dict], vectors: np.ndarray, seed: int = 0) -> tuple[np.ndarray, str]:
    """Text queries where the source has captions (one per image): text queries sit away from the
    image vectors, so they, not image vectors, show the recall users get. Else a sample of the vectors."""
    rng = np.random.default_rng(seed)
    captions = [row["captions"][0] for row in metadata if row.get("captions")]
    if captions:
        pick = rng.permutation(len(captions))[:RECALL_QUERIES]
        return encoder.encode_text([captions[i] for i in pick]), "captions of the indexed images, by the bundle's text tower"
    pick = rng.permutation(len(vectors))[:RECALL_QUERIES]
    return vectors[pick], "a sample of the indexed vectors (no captions: text queries may see lower recall)"


@dataclass(frozen=True)
class ImagePathPolicy:
    """Where the image paths in a vectors build's metadata may point: inside ``roots`` (relative paths
    are read under the first). A path outside them is refused, naming its shard and row, unless
    ``drop_outside``: then the row is kept without a file to serve (its url, if any, stays)."""

    roots: tuple[Path, ...]
    drop_outside: bool = False

    @classmethod
    def of(cls, roots: Sequence[str | Path], drop_outside: bool = False) -> ImagePathPolicy:
        for root in roots:
            if not Path(root).is_dir():
                raise BuildError(f"image root {root} is not a folder")
        return cls(tuple(Path(r).resolve() for r in roots), drop_outside)

    def confine(self, row: dict, where: str) -> bool:
        """Whether ``row`` keeps its image path (as recorded: the service resolves it again under the
        same roots); False when it was dropped."""
        if not row.get("path"):
            return True
        recorded = Path(str(row["path"]))
        if resolve_within(self.roots[0] / recorded, self.roots) is not None:  # an absolute path stays itself
            return True
        if not self.drop_outside:
            raise BuildError(f"{where}: image path {str(recorded)[:200]!r} is outside the image roots "
                             f"({', '.join(map(str, self.roots))}); name its folder with --image-root, or pass "
                             "--drop-outside-paths to index the row without a file to serve")
        del row["path"]
        return False


def bundle_ref(encoder: Encoder) -> BundleRef:
    return BundleRef(name=encoder.name, version=encoder.version, image_space=encoder.image_space)


def as_store(out: str | Path | SnapshotStore) -> SnapshotStore:
    """A snapshot root folder means the FAISS backend."""
    return out if isinstance(out, SnapshotStore) else FaissStore(Path(out))


def _finish(store: SnapshotStore, draft: VersionDraft, encoder: Encoder, spec: IndexSpec, index=None,
            activate: bool = True, target_recall: float | None = None,
            on_progress: Callable[[int, int], None] | None = None) -> tuple[str, SnapshotManifest]:
    """Build the index (unless given), measure its recall on caption queries, write and publish the version."""
    if len(np.unique(draft.ids)) != len(draft.ids):
        raise BuildError("duplicate image ids in the source (two images with the same id or path)")
    queries, source = _recall_queries(encoder, draft.metadata, draft.vectors)
    return store.write_version(draft, bundle_ref(encoder), spec, queries=queries, query_source=source, index=index,
                               target_recall=target_recall, activate=activate, on_progress=on_progress)


def default_target_recall(spec: IndexSpec | None, target_recall: float | None) -> float | None:
    """The recall to tune for: the one asked, or for an ``auto`` index (which turns approximate past
    the exact limit) ``AUTO_TARGET_RECALL``, so the default needs no expert flag. Exact indexes are
    never tuned (``measure_recall_with``)."""
    if target_recall is None and (spec is None or spec.type == "auto"):
        return AUTO_TARGET_RECALL
    return target_recall


def build_snapshot(
    source: str | Path | ImageSource,
    encoder: Encoder,
    out_root: str | Path | SnapshotStore,
    *,
    spec: IndexSpec | None = None,
    image_root: str | Path | None = None,
    batch_size: int = 32,
    workers: int | None = None,
    progress: bool = True,
    on_progress: BuildProgress | None = None,
    activate: bool = True,
    target_recall: float | None = None,
    reuse: bool = True,
    checksum: bool = False,
    known: KnownVectors | None = None,
) -> BuildResult:
    """Index a whole source into a new snapshot version and publish it as ``current``.

    ``out_root``: a snapshot root folder (FAISS) or any ``SnapshotStore`` (e.g. Milvus).
    ``target_recall`` (e.g. 0.95): tune the approximate index's search setting to reach that
    recall@10 on caption queries, and record the setting and its held-out recall in the manifest.

    With ``activate=False`` the version is written but not made current: the caller validates it and
    then calls the store's ``activate``.

    ``reuse``: photos whose file is unchanged since the current version indexed them (same path, size
    and modification time) keep that version's vectors when the same image tower made them
    (``unchanged_images``); only new and changed files are encoded. When nothing changed at all (the
    same files, captions, bundle and index settings: ``inputs_digest``), no version is written: the
    result is the current version, its report ``{"unchanged": True, ...}``. False encodes every file
    into a new version.

    ``checksum``: compare photos by their bytes, not their stamps (every photo is read and hashed first):
    a file replaced by another of the same size and modification time is encoded again, and the current
    version stays only when every photo it holds still has the bytes it recorded.

    ``known``: vectors the bundle's image tower made earlier for photos known by their bytes (the demo
    gallery's ship with the package): where the current version gives none, the photos among them are
    not encoded, as if that version held them.

    ``on_progress(phase, done, total)`` reports each phase as it goes (``BuildProgress``)."""
    began = time.perf_counter()
    report_phase = on_progress or _no_progress
    src, store, spec, target_recall, stamps, inputs = _image_build(source, encoder, out_root, spec, image_root,
                                                                   target_recall)
    total = len(src.records)
    digests = _checksum_digests(src, report_phase, progress) if reuse and checksum else None
    store.clean_stale()
    if reuse and (same := _current_built_from(store, encoder, inputs, src, digests)) is not None:
        same.report.update(images_total=total, seconds=round(time.perf_counter() - began, 3))
        return same
    version = store.begin_version()
    try:
        start = time.perf_counter()
        if reuse:
            report_phase("reusing", 0, total)
        reused, reused_from = (unchanged_in_current(store, encoder, src, stamps, digests) if reuse
                               else (Reused.none(encoder.dim), None))
        if known is not None and not len(reused.positions):
            reused = known.reusable(encoder.image_tower_id, src.root, src.records, stamps)
            reused_from = known.origin
        n_reused = len(reused.positions)
        taken = set(reused.positions.tolist())
        report_phase("encoding", n_reused, total)  # the reused photos count as done
        vectors, kept, sizes, skipped = embed_records(
            encoder, src.root, [r for i, r in enumerate(src.records) if i not in taken], batch_size=batch_size,
            workers=workers, progress=progress,
            on_progress=lambda done, _: report_phase("encoding", done + n_reused, total),
        )
        seconds = time.perf_counter() - start
        undecoded = [(s["path"], s.get(DIGEST_FIELD)) for s in skipped]
        skipped = src.rejected + skipped
        if not kept and not n_reused:
            raise BuildError(f"none of the {len(src.records)} files in {src.root} could be decoded as an image")
        encoded = len(kept)
        if n_reused:  # back into the source's order
            vectors, kept, sizes = _merged_in_source_order(src.records, reused, vectors, kept, sizes)
        ids = np.array([r.id for r in kept], dtype=np.int64)
        report = {
            "images_total": len(src.records), "indexed": len(kept), "encoded": encoded, "reused": n_reused,
            "reused_from": reused_from if n_reused else None, "moved": reused.moved, "skipped": skipped,
            "seconds": round(seconds, 3), "images_per_second": round(len(kept) / max(seconds, 1e-9), 2),
        }
        draft = VersionDraft(version, vectors, ids, _metadata(kept, sizes),
                             image_provenance(src, encoder, inputs, undecoded), report)
        report_phase("indexing", 0, len(kept))
        where, manifest = _finish(store, draft, encoder, spec, activate=activate, target_recall=target_recall,
                                  on_progress=lambda done, total: report_phase("indexing", done, total))
    except BaseException:
        store.abort_version(version)  # nothing half-written stays behind; current untouched
        raise
    return BuildResult(where, manifest, skipped, len(kept) / max(seconds, 1e-9), report)


def plan_build(source: str | Path | ImageSource, encoder: Encoder, out_root: str | Path | SnapshotStore, *,
               spec: IndexSpec | None = None, image_root: str | Path | None = None,
               target_recall: float | None = None, reuse: bool = True, checksum: bool = False,
               on_progress: BuildProgress | None = None) -> dict:
    """What ``build_snapshot`` with these arguments would do, with nothing encoded or written: whether
    the current version would stay (``unchanged``), else how many photos would keep the current
    version's vectors (``reuse``; ``moved`` of them found by their bytes) and how many would be encoded
    (``encode``: new and changed files, those that fail to decode included); a version that stays names
    how many files its build could not decode, still there unchanged (``undecodable``). ``on_progress``:
    its phases (hashing, reusing) as ``build_snapshot`` reports them."""
    report_phase = on_progress or _no_progress
    src, store, _, _, stamps, inputs = _image_build(source, encoder, out_root, spec, image_root, target_recall)
    total = len(src.records)
    digests = _checksum_digests(src, report_phase) if reuse and checksum else None
    plan: dict = {"images_total": total, "refused": len(src.rejected), "current": store.current_version()}
    if reuse and (same := _current_built_from(store, encoder, inputs, src, digests)) is not None:
        return {**plan, "unchanged": True, "reuse": same.manifest.count, "moved": 0, "encode": 0,
                "undecodable": len(same.skipped) - len(src.rejected)}
    if reuse:
        report_phase("reusing", 0, total)
    reused, _ = (unchanged_in_current(store, encoder, src, stamps, digests) if reuse
                 else (Reused.none(encoder.dim), None))
    return {**plan, "unchanged": False, "reuse": len(reused.positions), "moved": reused.moved,
            "encode": len(src.records) - len(reused.positions)}


def _no_progress(phase: str, done: int, total: int) -> None:
    return None


def _checksum_digests(src: ImageSource, report_phase: BuildProgress, progress: bool = False) -> list[str | None]:
    """Every record's digest for a checksum build or plan, reported as the "hashing" phase."""
    total = len(src.records)
    return source_digests(src, progress=progress, on_progress=lambda done, _: report_phase("hashing", done, total))


@collection_paused()
def _image_build(source: str | Path | ImageSource, encoder: Encoder, out_root: str | Path | SnapshotStore,
                 spec: IndexSpec | None, image_root: str | Path | None, target_recall: float | None):
    """What ``build_snapshot`` and ``plan_build`` start from: (the source, the store, the index spec and
    recall target in force, the files' stamps, the inputs digest)."""
    if not encoder.has_image_tower:
        raise BuildError(f"bundle {encoder.name} has no image tower: index with the bundle that has one")
    src = source if isinstance(source, ImageSource) else open_source(source, image_root)
    target_recall = default_target_recall(spec, target_recall)
    spec = spec or IndexSpec()
    stamps = source_stamps(src)
    return src, as_store(out_root), spec, target_recall, stamps, build_inputs(src, stamps, encoder, spec, target_recall)


def build_inputs(src: ImageSource, stamps: Sequence[list[int] | None], encoder: Encoder, spec: IndexSpec,
                 target_recall: float | None) -> str:
    """The ``inputs_digest`` an image build of ``src`` (its files stamped ``stamps``) records."""
    return inputs_digest(src.records, stamps, src.rejected, {
        "bundle": bundle_ref(encoder).model_dump(mode="json"), "image_tower": encoder.image_tower_id,
        "index": spec.model_dump(mode="json"), "target_recall": target_recall, "kind": src.kind,
        "root": str(src.root.resolve()), "annotations": str(src.annotations.resolve()) if src.annotations else None,
        "paraseek": __version__})


def image_provenance(src: ImageSource, encoder: Encoder, inputs: str,
                     undecoded: Iterable[tuple[str, str | None]] = ()) -> dict:
    """The manifest ``source`` of an image build: which source was indexed, by which image tower, its
    ``build_inputs`` digest and the ``skipped_digest`` of the files it could not decode (location, digest)."""
    root = str(src.root.resolve())
    return {"kind": src.kind, "root": root, "annotations": str(src.annotations.resolve()) if src.annotations else None,
            "image_roots": [root], TOWER_FIELD: encoder.image_tower_id, INPUTS_FIELD: inputs,
            SKIPPED_FIELD: skipped_digest(undecoded)}


def derived_provenance(source: dict) -> dict:
    """The provenance of a version made from another (an update, a copy): the other's, less its inputs
    digest (and its skipped files' digest), since a build of those inputs would not write this version."""
    return {k: v for k, v in source.items() if k not in (INPUTS_FIELD, SKIPPED_FIELD)}


@collection_paused()
def _current_built_from(store: SnapshotStore, encoder: Encoder, inputs: str, src: ImageSource,
                        digests: Sequence[str | None] | None = None) -> BuildResult | None:
    """The current version when a build of these very inputs wrote it and it still reads back whole
    (checksums on FAISS, the row count on Milvus): building again would write the same version. With
    ``digests`` (a checksum build), every photo it holds must also still have the bytes it recorded."""
    try:
        if store.current_version() is None:
            return None
        manifest = store.manifest()
        if manifest.source.get(INPUTS_FIELD) != inputs:
            return None
        snap = store.load(manifest.version, image_space=encoder.image_space, use_gpu=False)
        try:
            if digests is not None and not recorded_bytes_unchanged(snap, src.root, src.records, digests):
                log.info("the photos' bytes differ from those %s recorded: building", manifest.version)
                return None
            # the files it could not decode are still there, unchanged: still skipped
            skipped = src.rejected + _still_undecodable(snap, src.records, manifest.version)
        finally:
            snap.close()
    except (SnapshotError, IndexUnavailable) as exc:  # rebuilt (or refused) by the build that follows
        log.warning("not keeping the current version as it is: %s", exc)
        return None
    log.info("nothing changed since %s was built: it stays current", manifest.version)
    report: dict = {"unchanged": True, "indexed": manifest.count, "encoded": 0, "reused": 0, "reused_from": None,
                    "moved": 0, "skipped": skipped}
    return BuildResult(store.location(manifest.version), manifest, skipped, 0.0, report)


def _still_undecodable(snap: SearchableSnapshot, records: Sequence[ImageRecord], version: str) -> list[dict]:
    """The records a version built from these very inputs does not hold: the files its build could not decode."""
    if len(snap) >= len(records):
        return []  # it holds every one (the ids need not be read)
    missing = ~np.isin(np.fromiter((r.id for r in records), np.int64, len(records)), snap.held_ids())
    return [{"path": records[i].location, "error": f"could not be decoded when {version} was built, and is unchanged since"}
            for i in np.flatnonzero(missing).tolist()]


@collection_paused()
def unchanged_in_current(store: SnapshotStore, encoder: Encoder, src: ImageSource, stamps: Sequence[list[int] | None],
                         digests: Sequence[str | None] | None = None) -> tuple[Reused, str | None]:
    """The current version's vectors of the source's unchanged files (``stamps``: their ``file_stamp``s;
    ``digests``: their ``record_digest``s, in a checksum build), and that version's name (None when it has
    none to give: no current version, another image tower, or one that cannot be read)."""
    none = Reused.none(encoder.dim), None
    try:
        if encoder.image_tower_id is None or store.current_version() is None:
            return none
        if store.manifest().source.get(TOWER_FIELD) != encoder.image_tower_id:
            return none  # another tower (or vectors computed elsewhere): every photo is encoded
        base = store.load(image_space=encoder.image_space, use_gpu=False)  # read, not searched
    except SnapshotError as exc:  # reuse only saves time: a version that cannot be read is rebuilt from the files
        log.warning("not reusing vectors of the current version: %s", exc)
        return none
    try:
        reused = reusable_vectors(base, encoder.image_tower_id, src.root, src.records, stamps, digests)
    except (OSError, SnapshotError) as exc:  # e.g. the version pruned by another process while it was read
        log.warning("not reusing vectors of %s: %s", base.manifest.version, exc)
        return none
    finally:
        base.close()
    log.info("reusing %d of %d vectors from %s (files unchanged since)", len(reused.positions), len(src.records),
             base.manifest.version)
    return reused, base.manifest.version


def update_snapshot(
    root: str | Path | SnapshotStore,
    encoder: Encoder,
    *,
    add: str | Path | ImageSource | None = None,
    remove: Sequence[int] = (),
    retrain: bool = False,
    image_root: str | Path | None = None,
    progress: bool = True,
    activate: bool = True,
) -> BuildResult:
    """New version = current +/- images, without re-encoding the images already indexed.

    FAISS: flat and HNSW take new vectors as they are; IVF indexes keep their trained quantiser unless
    ``retrain``; removal rebuilds the index structure from the stored vectors (HNSW graphs cannot
    delete), still without re-encoding. Milvus: the new version's collection is filled from the
    current one's stored vectors plus the new images, and indexed by Milvus.

    With ``activate=False`` the version is written but not made current (as ``build_snapshot``).
    """
    store = as_store(root)
    base = store.load(image_space=encoder.image_space, use_gpu=False)  # its contents are read, not searched
    m = base.manifest
    source = derived_provenance(m.source)
    ids, vectors, metadata = base.contents()
    skipped: list[dict] = []
    added = 0
    if remove:
        unknown = sorted(set(int(r) for r in remove) - set(ids.tolist()))
        if unknown:
            raise SnapshotError(f"ids not in snapshot {m.version}: {unknown[:10]}")
        keep = ~np.isin(ids, np.asarray(remove, dtype=np.int64))
        vectors, ids = vectors[keep], ids[keep]
        metadata = [row for row, k in zip(metadata, keep) if k]
    if add is not None:
        src = add if isinstance(add, ImageSource) else open_source(add, image_root)
        if Path(m.source.get("root", "")).resolve() != src.root.resolve():
            # paths in metadata are relative to one root: keep them resolvable, and the new folder servable
            for rec in src.records:
                rec.path = str((src.root / rec.path).resolve())
            roots = [str(r) for r in base.image_roots]
            source = {**source, "image_roots": roots + [r for r in [str(src.root.resolve())] if r not in roots]}
        present = set(ids.tolist())
        new = [r for r in src.records if r.id not in present]
        new_vec, kept, sizes, skipped = embed_records(encoder, src.root, new, progress=progress)
        if kept and source.get(TOWER_FIELD) != encoder.image_tower_id:
            source[TOWER_FIELD] = None  # vectors of two towers: a later build reuses none of them
        vectors = np.concatenate([vectors, new_vec])
        ids = np.concatenate([ids, np.array([r.id for r in kept], np.int64)])
        metadata += _metadata(kept, sizes)
        added = len(kept)
    if len(ids) == 0:
        raise BuildError("the update would leave the snapshot empty")

    spec = m.index
    index: faiss.Index | None = None
    if isinstance(base, Snapshot):  # FAISS: reuse the trained index rather than rebuild it
        index = faiss.read_index(str(base.path / "index.faiss"))
        if remove:
            if spec.type == "hnsw":
                index = None  # HNSW graphs cannot delete: rebuild from the stored vectors
            else:
                index.remove_ids(np.asarray(list(remove), dtype=np.int64))  # type: ignore[arg-type]  # SWIG takes arrays
        if index is not None and added:
            index.add_with_ids(np.ascontiguousarray(vectors[-added:], np.float32), ids[-added:])
    if retrain:
        index, spec = None, spec.model_copy(update={"nlist": None, "pq_m": None})
    base.close()
    report = {"parent": m.version, "added": added, "removed": len(remove), "skipped": skipped,
              "retrained": retrain, "index_rebuilt": index is None}
    draft = VersionDraft(store.new_version_name(), vectors, ids, metadata, source, report, parent=m.version)
    where, manifest = _finish(store, draft, encoder, spec, index=index, activate=activate)
    return BuildResult(where, manifest, skipped, report=report)


def _read_vector_shards(src: VectorSource, vectors: np.ndarray, ids: np.ndarray, meta_out, normalize: bool,
                        progress: bool, paths: ImagePathPolicy) -> int:
    """Stream every shard into ``vectors``/``ids`` (memory maps) and its metadata rows to ``meta_out``,
    their image paths confined to ``paths``; returns how many paths were dropped. Ids are checked unique
    as each shard arrives, against a sorted array of those seen (8 bytes an id, not a Python dict)."""
    seen = np.empty(0, np.int64)
    starts: list[tuple[int, str]] = []  # (first position, shard name): where a repeated id was first used
    position = 0
    dropped = 0
    with tqdm(total=src.count, desc="reading vectors", unit="vec", disable=not progress) as bar:
        for shard, shard_vectors, shard_ids, rows in iter_shards(src, normalize):
            starts.append((position, shard.vectors.name))
            _check_new_ids(shard_ids, seen, ids[:position], starts, shard.vectors.name)
            seen = np.sort(np.concatenate([seen, shard_ids]))
            end = position + len(shard_ids)
            vectors[position:end] = shard_vectors
            ids[position:end] = shard_ids
            for row, row_meta in enumerate(rows):
                where = f"shard {shard.vectors.name}" + (f" (metadata {shard.metadata.name})" if shard.metadata else "")
                dropped += not paths.confine(row_meta, f"{where} row {row}")
                meta_out(row_meta)
            position = end
            bar.update(len(shard_ids))
    return dropped


def _check_new_ids(shard_ids: np.ndarray, seen: np.ndarray, earlier: np.ndarray, starts: list[tuple[int, str]],
                   name: str) -> None:
    """BuildError naming the first row of shard ``name`` whose id is used before it (earlier in the shard,
    or in an earlier shard: ``earlier`` holds their ids by position, ``seen`` the same sorted)."""
    order = np.argsort(shard_ids, kind="stable")
    ordered = shard_ids[order]
    again = np.zeros(len(shard_ids), bool)
    again[order[1:][ordered[1:] == ordered[:-1]]] = True  # a later row of an id repeated within the shard
    if len(seen):
        pos = np.minimum(np.searchsorted(seen, shard_ids), len(seen) - 1)
        again |= seen[pos] == shard_ids
    if not again.any():
        return
    row = int(np.argmax(again))
    image_id = int(shard_ids[row])
    before = np.flatnonzero(earlier == image_id)
    if len(before):
        first = int(before[0])
        at, where = max((s for s in starts if s[0] <= first), key=lambda s: s[0])
        used = f"shard {where} row {first - at}"
    else:
        used = f"shard {name} row {int(np.flatnonzero(shard_ids == image_id)[0])}"
    raise BuildError(f"shard {name} row {row}: id {image_id} already used in {used}")


def _vector_queries(queries: np.ndarray | None, vectors: np.ndarray, dim: int, rng) -> tuple[np.ndarray, str]:
    if queries is not None:
        queries = np.asarray(queries, np.float32)
        if queries.ndim != 2 or queries.shape[1] != dim:
            raise BuildError(f"query vectors have shape {queries.shape}, the collection's dimension is {dim}")
        return queries, "the query vectors given"
    count = len(vectors)
    sample = np.asarray(vectors[np.sort(rng.choice(count, size=min(RECALL_QUERIES, count), replace=False))])
    return sample, "a sample of the indexed vectors (give text-query vectors for the recall text queries see)"


def build_snapshot_from_vectors(
    source: str | Path | VectorSource,
    out_root: str | Path | SnapshotStore,
    *,
    image_space: str,
    bundle_name: str = "precomputed",
    bundle_version: str = "",
    metadata: str | Path | None = None,
    spec: IndexSpec | None = None,
    normalize: bool = False,
    train_sample: int | None = None,
    chunk: int = ADD_CHUNK_ROWS,
    progress: bool = True,
    activate: bool = True,
    target_recall: float | None = None,
    queries: np.ndarray | None = None,
    image_roots: Sequence[str | Path] | None = None,
    drop_outside_paths: bool = False,
) -> BuildResult:
    """Index precomputed image embeddings (``paraseek.index.vector_sources`` layouts) into a new snapshot version.

    ``image_roots``: the folders the metadata's image paths may point into, recorded in the manifest as
    the only places the service serves images from (default: the embeddings' folder). A path outside
    them is refused with its shard and row, or with ``drop_outside_paths`` left out of its row.

    ``image_space`` names the image tower the vectors came from: a bundle with that image space can
    search the snapshot, any other is refused. Shards are streamed: vectors go to the version's
    ``vectors.npy`` on disk one shard at a time, IVF/PQ quantisers train on a random sample of
    ``train_sample`` rows (default 100K, or 20 per IVF list when more), and the index takes the vectors
    back in chunks, so memory holds one shard, the sample and the index itself (use ``ivf_pq`` when the
    raw vectors would not fit). Into another store (Milvus) the vectors stream through a temporary memory
    map into the store's own writer.

    ``queries``: sample text-query embeddings (by the text tower aligned to these vectors) that recall
    is measured, and with ``target_recall`` tuned, on; without them a sample of the vectors stands in.
    """
    src = source if isinstance(source, VectorSource) else open_vector_source(source, metadata)
    target_recall = default_target_recall(spec, target_recall)
    if not image_space.strip():
        raise BuildError("name the image space the vectors came from (--image-space, or --bundle with that image tower)")
    store = as_store(out_root)
    ref = BundleRef(name=bundle_name, version=bundle_version, image_space=image_space)
    paths = ImagePathPolicy.of(image_roots or [src.root], drop_outside_paths)
    provenance = {"kind": f"vectors:{src.kind}", "root": str(src.root.resolve()), "shards": [s.vectors.name for s in src.shards],
                  "image_roots": [str(r) for r in paths.roots]}
    if not isinstance(store, FaissStore):
        return _vectors_into_store(src, store, ref, provenance, spec or IndexSpec(), normalize, progress, activate,
                                   target_recall, queries, paths)
    root = store.root
    store.clean_stale()
    version = store.begin_version()
    stage = store.staging(version)
    count, dim = src.count, src.dim
    memory = MemorySampler(interval=0.5).start()  # the build's peak, stated in its report
    try:
        start = time.perf_counter()
        spec = (spec or IndexSpec()).resolved(count, dim)
        vectors = np.lib.format.open_memmap(stage / "vectors.npy", mode="w+", dtype=np.float32, shape=(count, dim))
        ids = np.empty(count, np.int64)
        names: set[str] = set()
        with open(stage / "metadata.jsonl", "w", encoding="utf-8") as meta:
            def write(row: dict) -> None:
                names.update((row.get("fields") or {}).keys())
                meta.write(json.dumps(row, ensure_ascii=False) + "\n")
            dropped = _read_vector_shards(src, vectors, ids, write, normalize, progress, paths)
        vectors.flush()
        index = create_index(spec, dim)
        rng = np.random.default_rng(0)
        if not index.is_trained:
            # k-means wants ~39 points a list (faiss warns below): past 100K, 20 a list bounds the training time
            size = train_sample or max(100_000, 20 * (spec.nlist or 1))
            sample = np.sort(rng.choice(count, size=min(size, count), replace=False))
            index.train(np.ascontiguousarray(vectors[sample]))
        with tqdm(total=count, desc="indexing", unit="vector", disable=not progress) as bar:
            add_in_chunks(index, vectors, ids, add_chunk_rows(spec, chunk), on_added=lambda done: bar.update(done - bar.n))
        seconds = time.perf_counter() - start
        queries, query_source = _vector_queries(queries, vectors, dim, rng)
        spec, recall, n_queries, tuning = measure_recall(index, spec, vectors, ids, queries, target_recall=target_recall,
                                                         query_source=query_source)
        faiss.write_index(index, str(stage / "index.faiss"))
        np.save(stage / "ids.npy", ids)
        memory.stop()
        report = {"vectors_total": count, "indexed": count, "shards": len(src.shards), "skipped": [],
                  "paths_outside_roots_dropped": dropped,
                  "seconds": round(seconds, 3), "vectors_per_second": round(count / max(seconds, 1e-9), 1),
                  # RSS counts the pages of vectors.npy written through its memory map (page cache the kernel
                  # can drop); the private part is the build's own heap: the sample, a shard, the index
                  "peak_rss_mb": round(memory.peak_rss), "peak_private_mb": round(memory.peak_private),
                  "disk_bytes": sum(p.stat().st_size for p in stage.iterdir() if p.is_file())}
        (stage / "report.json").write_text(json.dumps(report, indent=2))
        draft = VersionDraft(version, vectors, ids, [], provenance, report)  # the metadata is on disk already
        manifest = draft.manifest(ref, spec, recall, n_queries, tuning, backend="faiss", user_fields=sorted(names))
        final, manifest = publish(root, stage, manifest, activate=activate)
    except BaseException:
        shutil.rmtree(stage, ignore_errors=True)  # nothing half-written stays behind; current untouched
        raise
    finally:
        memory.stop()
    return BuildResult(str(final), manifest, [], count / max(seconds, 1e-9), report)


def _vectors_into_store(src: VectorSource, store: SnapshotStore, ref: BundleRef, provenance: dict, spec: IndexSpec,
                        normalize: bool, progress: bool, activate: bool, target_recall: float | None,
                        queries: np.ndarray | None, paths: ImagePathPolicy) -> BuildResult:
    count, dim = src.count, src.dim
    store.clean_stale()
    with tempfile.TemporaryDirectory(prefix="paraseek-vectors-") as tmp:
        start = time.perf_counter()
        vectors = np.lib.format.open_memmap(Path(tmp) / "vectors.npy", mode="w+", dtype=np.float32, shape=(count, dim))
        ids = np.empty(count, np.int64)
        rows: list[dict] = []
        dropped = _read_vector_shards(src, vectors, ids, rows.append, normalize, progress, paths)
        seconds = time.perf_counter() - start
        queries, query_source = _vector_queries(queries, vectors, dim, np.random.default_rng(0))
        report = {"vectors_total": count, "indexed": count, "shards": len(src.shards), "skipped": [],
                  "paths_outside_roots_dropped": dropped,
                  "seconds": round(seconds, 3), "vectors_per_second": round(count / max(seconds, 1e-9), 1)}
        draft = VersionDraft(store.new_version_name(), vectors, ids, rows, provenance, report)
        where, manifest = store.write_version(draft, ref, spec, queries=queries, query_source=query_source,
                                              target_recall=target_recall, activate=activate)
    return BuildResult(where, manifest, [], count / max(seconds, 1e-9), report)


def export_snapshot_vectors(snapshot: str | Path, out: str | Path, *, shard_size: int = 1_000_000,
                            metadata_format: str = "parquet", progress: bool = True) -> list[Path]:
    """Write a snapshot's vectors and metadata back out in clip-retrieval's layout
    (``img_emb/img_emb_{i}.npy`` + ``metadata/metadata_{i}.{parquet|jsonl}``, an ``id`` column first),
    which ``build_snapshot_from_vectors`` reads back as it is."""
    if metadata_format not in ("parquet", "jsonl"):
        raise BuildError(f"metadata format must be parquet or jsonl, not {metadata_format!r}")
    snap = Snapshot.load(snapshot, use_gpu=False)
    out = Path(out)
    (out / "img_emb").mkdir(parents=True, exist_ok=True)
    (out / "metadata").mkdir(parents=True, exist_ok=True)
    vectors = snap.vectors()
    written = []
    for number, begin in enumerate(tqdm(range(0, len(snap.ids), shard_size), desc="exporting", unit="shard", disable=not progress)):
        ids = snap.ids[begin:begin + shard_size]
        np.save(out / "img_emb" / f"img_emb_{number}.npy", np.asarray(vectors[begin:begin + shard_size], np.float32))
        rows = [_export_row(meta, int(i)) for meta, i in zip(snap.metadata.rows(begin, begin + len(ids)), ids)]
        target = out / "metadata" / f"metadata_{number}.{metadata_format}"
        if metadata_format == "parquet":
            try:
                import pyarrow as pa  # optional: only parquet output needs it
                import pyarrow.parquet as pq
            except ImportError as exc:
                raise BuildError("parquet output needs pyarrow (pip install pyarrow), or use --format jsonl") from exc
            pq.write_table(pa.Table.from_pylist(rows), target)
        else:
            with open(target, "w", encoding="utf-8") as f:
                for row in rows:
                    f.write(json.dumps(row, ensure_ascii=False) + "\n")
        written.append(target)
    (out / "image_space.txt").write_text(snap.manifest.image_space + "\n")
    return written


def _export_row(meta: dict, image_id: int) -> dict:
    """A snapshot metadata row in the flat column names clip-retrieval users read (id, image_path,
    caption, url, license, then user fields); nested values become JSON text."""
    row: dict = {"id": image_id}
    if meta.get("path"):
        row["image_path"] = meta["path"]
    if meta.get("captions"):
        row["caption"] = meta["captions"][0]
        if len(meta["captions"]) > 1:
            row["captions"] = json.dumps(meta["captions"])
    url = meta.get("url") or meta.get("coco_url") or meta.get("flickr_url")
    if url:
        row["url"] = url
    if meta.get("license"):
        lic = meta["license"]
        row["license"] = lic.get("name") if isinstance(lic, dict) and set(lic) == {"name"} else json.dumps(lic)
    for key, value in (meta.get("fields") or {}).items():
        row.setdefault(key, value)
    return row


def copy_snapshot(source: SearchableSnapshot, store: SnapshotStore, *, spec: IndexSpec | None = None,
                  encoder: Encoder | None = None, activate: bool = True, target_recall: float | None = None) -> BuildResult:
    """Publish a loaded version's vectors and metadata as a new version of another store (FAISS to
    Milvus when a collection outgrows one machine, or back), without re-encoding anything. The index
    type is the source's unless ``spec`` is given; recall is measured on caption queries when an
    ``encoder`` aligned to the snapshot is given, else on a sample of the vectors."""
    m = source.manifest
    ids, vectors, metadata = source.contents()
    if len(ids) == 0:
        raise BuildError(f"snapshot {m.version} is empty: nothing to copy")
    store.clean_stale()
    report = {"copied_from": {"backend": m.backend, "version": m.version}, "indexed": len(ids), "skipped": []}
    draft = VersionDraft(store.new_version_name(), vectors, ids, metadata, derived_provenance(m.source), report)
    if encoder is not None:
        queries, query_source = _recall_queries(encoder, metadata, vectors)
    else:
        queries, query_source = _vector_queries(None, vectors, m.dim, np.random.default_rng(0))
    target = spec or m.index.model_copy(update={"refine_factor": None})
    where, manifest = store.write_version(draft, m.bundle, target, queries=queries, query_source=query_source,
                                          target_recall=target_recall, activate=activate)
    return BuildResult(where, manifest, [], report=report)
