"""Filtered ANN search on a large snapshot: what the first search under a new filter costs (the filter's
rows and its id selector), what each later one costs, and with which selector. The id selector a
filtered view uses (``faiss_index.id_selector``: a bitmap of the ids) and faiss' hash set of ids are
measured side by side on the same view, the same queries, alternating; medians. A third row searches
with the bitmap and the snapshot's unfiltered setting (nprobe / efSearch as tuned) instead of the one
widened for the filter's share (``FilteredSnapshot.filtered_spec``): what the widening costs and gains.

    python -m paraseek.loadtests.bench_filters [--size 1000000] [--work DIR] [--snapshot ROOT]

Without ``--snapshot`` a synthetic collection (bench_index's caption-like mix, 384-d) is built under
``--work`` once and reused: flat up to 200K vectors, IVF-PQ with refine tuned to recall 0.95 beyond.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import numpy as np

from paraseek.core.cpu_threads import import_faiss
from paraseek.core.memory import process_memory
from paraseek.index.faiss_index import IndexSpec, id_selector, masked_exact_search
from paraseek.index.filters import SearchFilter
from paraseek.index.snapshot import FilteredSnapshot, Snapshot
from paraseek.loadtests import DEFAULT_DATA, temporary_folder
from paraseek.loadtests.bench_service import build_synthetic_snapshot, synthetic_space
from paraseek.loadtests.machine import cpu_description

SHARES = (0.5, 0.1, 0.01)  # of the collection a filter keeps


def synthetic_snapshot(size: int, work: Path, data: Path) -> Path:
    root = work / f"synthetic-384-{size}"
    if not (root / "current").is_file():
        build_synthetic_snapshot(root, size, 384, work, data, image_space="bench/synthetic-384", bundle_name="synthetic")
    return root


class AsTuned(FilteredSnapshot):
    """A filtered view searched with the snapshot's unfiltered setting: what the widening is measured against."""

    def filtered_spec(self):
        return self.snapshot.manifest.index


def setting(spec: IndexSpec) -> str:
    return f"ef {spec.ef_search}" if spec.type == "hnsw" else f"nprobe {spec.nprobe}"


def searched_with(view: FilteredSnapshot) -> str:
    """The search setting a view's top-10 searches run with."""
    return "exact scan" if view.scans_exactly(10) else setting(view.filtered_spec())


def search_ms(view: FilteredSnapshot, queries: np.ndarray) -> float:
    start = time.perf_counter()
    view.search_ids(queries, 10)
    return (time.perf_counter() - start) * 1000


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--snapshot", type=Path, default=None, help="a FAISS snapshot root (default: a synthetic one)")
    p.add_argument("--size", type=int, default=1_000_000, help="vectors of the synthetic snapshot")
    p.add_argument("--work", type=Path, default=None, help="where the synthetic snapshot is built (reused)")
    p.add_argument("--data", type=Path, default=DEFAULT_DATA)
    p.add_argument("--rounds", type=int, default=15, help="searches per selector and batch size (medians)")
    args = p.parse_args(argv)
    root = args.snapshot
    if root is None:  # built once into --work when given
        work = args.work or temporary_folder("paraseek-bench-filters-")
        work.mkdir(parents=True, exist_ok=True)
        root = synthetic_snapshot(args.size, work, args.data)
    snap = Snapshot.load(root)
    queries = synthetic_space(snap.manifest.dim, args.data)[1][:32]
    spec = snap.manifest.index
    print(f"filtered search: {len(snap):,} x {snap.manifest.dim} {spec.type} ({setting(spec)}), id-range filters, "
          f"{args.rounds} searches each, medians; {cpu_description()}")
    print(f"{'keeps':>6} {'rows':>10} {'first ms':>9} {'selector':9} {'search':>12} {'build ms':>9} {'+MB':>7} {'b1 ms':>7} "
          f"{'b32 ms':>7} {'b1 ratio':>9} {'recall':>7}")
    ok = True
    ordered = np.sort(snap.ids)
    for share in SHARES:
        flt = SearchFilter(id_range={"lt": int(ordered[int(share * len(ordered))])})
        start = time.perf_counter()
        view = snap.filtered(flt)
        view.search_ids(queries[:1], 10)
        first_ms = (time.perf_counter() - start) * 1000
        matching = snap.ids[view.rows]
        rows = []  # (selector, view, selector build ms, MB it added)
        for name, make in (("bitmap", id_selector), ("hash set", import_faiss().IDSelectorBatch)):
            before = process_memory().private_mb
            start = time.perf_counter()
            selector = make(matching)
            build_ms = (time.perf_counter() - start) * 1000
            rows.append((name, FilteredSnapshot(snap, view.rows, selector), build_ms, process_memory().private_mb - before))
        rows.append(("bitmap", AsTuned(snap, view.rows, rows[0][1].search_params().sel), 0.0, 0.0))
        timings: list[dict[int, list[float]]] = [{1: [], 32: []} for _ in rows]
        for _ in range(args.rounds):  # alternate, so a drift of the machine hits every row alike
            for (_, other, _, _), timed in zip(rows, timings):
                for batch in (1, 32):
                    timed[batch].append(search_ms(other, queries[:batch]))
        _, truth = masked_exact_search(snap.vectors(), snap.ids, view.rows, queries, 10)
        for i, ((name, other, build_ms, grown), timed) in enumerate(zip(rows, timings)):
            _, got = other.search_ids(queries, 10)
            recall = float(np.mean([len(set(a) & set(b)) / 10 for a, b in zip(got.tolist(), truth.tolist())]))
            b1, b32 = statistics.median(timed[1]), statistics.median(timed[32])
            ratio = b1 / statistics.median(timings[0][1])
            ok &= bool(np.isin(got[got >= 0], matching).all())
            print(f"{share:6.0%} {len(view):>10,} {first_ms if i == 0 else float('nan'):9.1f} {name:9} "
                  f"{searched_with(other):>12} {build_ms:9.1f} {grown:7.1f} {b1:7.2f} {b32:7.2f} {ratio:9.2f} {recall:7.3f}", flush=True)
    start = time.perf_counter()
    snap.filtered(SearchFilter(licence=[1])).search_ids(queries[:1], 10)
    print(f"a licence filter's first search (parses every metadata row once): {(time.perf_counter() - start) * 1000:.0f} ms")
    print("b1 ratio: the row's p50 at batch 1 over the first bitmap row's; first ms: the first search under the filter "
          "(its rows, its selector, one search); +MB: private memory the selector added; search: the setting searched "
          "with (the third row of a share: the snapshot's unfiltered one)")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
