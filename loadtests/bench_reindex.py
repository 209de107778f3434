"""A reindex that encodes every photo against one that reuses the vectors of unchanged photos, one run, medians.

The collection is the COCO-mini photos (val and train, 239) copied into a folder and indexed once. Each
round then edits ``--changed`` of the photos (a bit of each file flipped: other bytes, a new time) and
adds nothing, moves ``--moved`` of them into another folder (renamed: found by their bytes), and times
two builds of the folder side by side, alternating which goes first: one with
``reuse=False`` (every photo encoded, what a reindex cost before) and one as a reindex runs by default
(the current version's vectors for unchanged files). Both publish a version into their own store. The
ratio is the reused build's speed-up; the vectors of both builds are compared to show they agree.
Last, the reusing store is built ``--rounds`` times more with nothing changed: no version is written; and
as many times with ``checksum=True`` (every photo read and hashed, compared with the digests recorded).

    python -m paraseek.loadtests.bench_reindex [--data ../shared/data] [--bundle DIR] [--changed 0.05] [--moved 0.5]
        [--rounds 3] [--files 100000]

Without ``--bundle`` the starter is built as shipped (its whole photo and 3 x 3 crops: torch needed).
With ``--files N`` it also times what a rebuild of a folder of N unchanged files spends before encoding
anything: listing and confining the folder, finding every file's vector in the current version (a
version of placeholder files and random vectors, written as a build of them would write it), and the
digest of the inputs that tells a rebuild with nothing changed; and a whole rebuild of that folder with
nothing changed (it keeps the version: no file is decoded), by stamps and with ``checksum=True`` (each
placeholder is 11 bytes: that row is the per-file cost of hashing; the photos' row gives the cost per byte).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

from paraseek.core.encoder import Encoder
from paraseek.index.builder import build_inputs, build_snapshot, bundle_ref, image_provenance, unchanged_in_current
from paraseek.index.faiss_index import IndexSpec
from paraseek.index.image_sources import open_source
from paraseek.index.snapshot import FaissStore
from paraseek.index.unchanged_images import DIGEST_FIELD, STAMP_FIELD, content_digest, source_stamps
from paraseek.index.versions import VersionDraft
from paraseek.loadtests import DEFAULT_DATA


def copy_photos(data: Path, folder: Path, limit: int | None) -> list[Path]:
    photos = sorted((data / "coco-mini" / "val2017").glob("*.jpg")) + sorted((data / "coco-mini" / "train2017").glob("*.jpg"))
    folder.mkdir(parents=True)
    copies = []
    for p in photos[:limit]:
        shutil.copy(p, folder / p.name)
        copies.append(folder / p.name)
    return copies


def vectors(store: FaissStore) -> dict[int, np.ndarray]:
    snap = store.load(use_gpu=False)
    ids, vecs, _ = snap.contents()
    return {int(i): np.asarray(v) for i, v in zip(ids, vecs)}


def lookup_seconds(encoder: Encoder, folder: Path, n: int, rounds: int) -> dict[str, float]:
    """Median seconds to open a folder of ``n`` unchanged files as a source (``open_s``), then to find their
    vectors (``find_s``), to digest the source's inputs (``digest_s``: what ``build_snapshot`` compares with
    the current version's), and of a whole ``build_snapshot`` with nothing changed (``unchanged_build_s``; with
    ``checksum=True``: ``unchanged_checksum_build_s``)."""
    for i in range(n):
        path = folder / f"{i // 1000:04d}" / f"{i:08d}.jpg"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"placeholder")
    src = open_source(folder)
    vecs = np.random.default_rng(0).standard_normal((n, encoder.dim)).astype(np.float32)
    vecs /= np.linalg.norm(vecs, axis=1, keepdims=True)
    stamps = source_stamps(src)
    digest = content_digest(b"placeholder")
    rows = [{"id": r.id, "path": r.path, "width": 640, "height": 480, STAMP_FIELD: stamp, DIGEST_FIELD: digest}
            for r, stamp in zip(src.records, stamps)]
    store = FaissStore(folder.parent / "lookup-snap")
    spec = IndexSpec(type="flat")
    draft = VersionDraft(store.begin_version(), vecs, np.array([r.id for r in src.records], np.int64), rows,
                         image_provenance(src, encoder, build_inputs(src, stamps, encoder, spec, None)), {})
    store.write_version(draft, bundle_ref(encoder), spec, queries=vecs[:10], query_source="a sample")
    opened, found, digested, whole, hashed = [], [], [], [], []
    for _ in range(rounds):
        t0 = time.perf_counter()
        src = open_source(folder)
        t1 = time.perf_counter()
        stamps = source_stamps(src)
        reused, _ = unchanged_in_current(store, encoder, src, stamps)
        t2 = time.perf_counter()
        build_inputs(src, stamps, encoder, spec, None)
        digested.append(time.perf_counter() - t2)
        found.append(t2 - t1)
        opened.append(t1 - t0)
        assert len(reused.positions) == n, "every unchanged file's vector is found"
        t3 = time.perf_counter()
        kept = build_snapshot(folder, encoder, store, spec=spec, progress=False)
        whole.append(time.perf_counter() - t3)
        assert kept.report.get("unchanged"), "a build of the unchanged folder keeps the version"
        t4 = time.perf_counter()
        kept = build_snapshot(folder, encoder, store, spec=spec, progress=False, checksum=True)
        hashed.append(time.perf_counter() - t4)
        assert kept.report.get("unchanged"), "a checksum build of the unchanged folder keeps the version"
    return {"open_s": statistics.median(opened), "find_s": statistics.median(found),
            "digest_s": statistics.median(digested), "unchanged_build_s": statistics.median(whole),
            "unchanged_checksum_build_s": statistics.median(hashed)}


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data", type=Path, default=DEFAULT_DATA)
    p.add_argument("--bundle", type=Path, default=None, help="bundle with an image tower (default: the starter as shipped)")
    p.add_argument("--changed", type=float, default=0.05, help="share of the photos rewritten before each round")
    p.add_argument("--moved", type=float, default=0.0, help="share of the photos moved to another folder before each round")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--photos", type=int, default=None, help="index only the first N photos")
    p.add_argument("--files", type=int, default=0, help="also time finding the vectors of N unchanged files")
    args = p.parse_args(argv)

    tmp = Path(tempfile.mkdtemp(prefix="paraseek-bench-reindex-"))
    try:
        bundle = args.bundle
        if bundle is None:
            from paraseek.training.export.starter import build_starter  # torch, lazily: only without --bundle

            bundle = tmp / "starter"
            build_starter(bundle, int8=False)
        encoder = Encoder(bundle)
        photos = copy_photos(args.data, tmp / "photos", args.photos)
        stores = {"encode all": FaissStore(tmp / "all"), "reuse unchanged": FaissStore(tmp / "reuse")}
        for store in stores.values():
            build_snapshot(tmp / "photos", encoder, store, progress=False)
        rng = np.random.default_rng(0)
        n_changed = max(1, round(args.changed * len(photos)))
        n_moved = round(args.moved * len(photos))
        seconds: dict[str, list[float]] = {name: [] for name in stores}
        encoded: dict[str, list[int]] = {name: [] for name in stores}
        moved: list[int] = []
        for r in range(args.rounds):
            if n_moved:
                (tmp / "photos" / f"moved-{r}").mkdir()
            for i in rng.choice(len(photos), n_moved, replace=False):
                photos[i] = photos[i].rename(tmp / "photos" / f"moved-{r}" / photos[i].name)  # mv: same bytes and time
            for i in rng.choice(len(photos), n_changed, replace=False):
                edited = bytearray(photos[i].read_bytes())
                edited[len(edited) // 2 + r] ^= 1  # an edit: other bytes (a flipped bit of entropy-coded data still decodes)
                photos[i].write_bytes(bytes(edited))
                later = time.time_ns() + 10**9 * (r + 1)  # the stamp moves even on a coarse file-system clock
                os.utime(photos[i], ns=(later, later))
            order = list(stores) if r % 2 == 0 else list(stores)[::-1]
            for name in order:
                t0 = time.perf_counter()
                built = build_snapshot(tmp / "photos", encoder, stores[name], progress=False, reuse=name == "reuse unchanged")
                seconds[name].append(time.perf_counter() - t0)
                encoded[name].append(built.report["encoded"])
                if name == "reuse unchanged":
                    moved.append(built.report["moved"])
        def kept_seconds(checksum: bool) -> float:
            """Median seconds of a build of the reusing store with nothing changed (the version kept)."""
            times = []
            for _ in range(args.rounds):
                t0 = time.perf_counter()
                same = build_snapshot(tmp / "photos", encoder, stores["reuse unchanged"], progress=False, checksum=checksum)
                times.append(time.perf_counter() - t0)
                assert same.report.get("unchanged"), "a build with nothing changed keeps the current version"
            return statistics.median(times)

        kept, kept_by_bytes = kept_seconds(checksum=False), kept_seconds(checksum=True)
        photo_bytes = sum(p.stat().st_size for p in photos)
        a, b = vectors(stores["encode all"]), vectors(stores["reuse unchanged"])
        worst = max(float(np.abs(a[i] - b[i]).max()) for i in a) if set(a) == set(b) else float("inf")
        median = {name: statistics.median(s) for name, s in seconds.items()}
        print(f"reindex of {len(photos)} photos with {n_changed} edited ({args.changed:.0%}) and {n_moved} moved "
              f"({args.moved:.0%}) before each of {args.rounds} rounds, bundle {encoder.name}; medians; the reusing build "
              f"found {statistics.median(moved):.0f} moved photos by their bytes")
        print(f"{'build':16} {'seconds':>8} {'encoded':>8}")
        for name in stores:
            print(f"{name:16} {median[name]:8.2f} {statistics.median(encoded[name]):8.0f}")
        print(f"{'nothing changed':16} {kept:8.2f} {0:8d}  (no version written)")
        print(f"{'  by checksum':16} {kept_by_bytes:8.2f} {0:8d}  (no version written; "
              f"{photo_bytes / 2**20:.0f} MiB read and hashed, {photo_bytes / 2**20 / kept_by_bytes:.0f} MiB/s)")
        speedup = median["encode all"] / median["reuse unchanged"]
        print(f"reuse unchanged / encode all: {speedup:.1f}x faster; largest difference between their vectors {worst:.2e}")
        result: dict = {"seconds": median, "encoded": {k: statistics.median(v) for k, v in encoded.items()}, "speedup": speedup,
                  "max_abs_difference": worst, "photos": len(photos), "changed": n_changed, "moved": statistics.median(moved),
                  "unchanged_s": kept, "unchanged_checksum_s": kept_by_bytes}
        if args.files:
            lookup = lookup_seconds(encoder, tmp / "many", args.files, args.rounds)
            opened, found = lookup["open_s"], lookup["find_s"]
            print(f"a rebuild of {args.files} unchanged files before encoding anything: {opened:.2f} s listing and confining "
                  f"the folder, {found:.2f} s finding their vectors ({(opened + found) / args.files * 1e6:.0f} us a file); "
                  f"{lookup['digest_s']:.2f} s digesting its inputs; a whole build of the folder with nothing changed "
                  f"{lookup['unchanged_build_s']:.2f} s (the version kept), {lookup['unchanged_checksum_build_s']:.2f} s "
                  f"with --checksum")
            result["lookup"] = {"files": args.files, **lookup}
        return result
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
