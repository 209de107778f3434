"""FAISS against Milvus on the same vectors and queries, one run, medians, printed side by side.

For each index (FAISS flat / IVF-Flat / HNSW and Milvus FLAT / IVF_FLAT / HNSW with the same
parameters, and Milvus DISKANN, which FAISS has no counterpart of) it measures: the time to build a
version through the store (insert + index + publish; a Milvus version is published once the server
has indexed it), recall@10 against exact search, p50 latency at batch 1, queries/s at batch 64, and
filtered searches matching 1 %, 10 % and 50 % of the collection (p50 at batch 1 and recall@10
against the exact top 10 among the matching vectors; "short": filtered queries answered with fewer
than 10 hits, of 3 x the queries), and the reads a server makes of a version published a
while ago: the current version (each snapshot poll) and its manifest (each start and reload). Each Milvus row
ends with its ratio to the FAISS row of the same kind.

The vectors are the index benchmark's synthetic mix around real CLIP image embeddings, the queries
its noisy real caption embeddings (``paraseek.loadtests.bench_index``). Milvus is Milvus Lite in this
process unless ``--milvus-uri`` names a server.

    python -m paraseek.loadtests.bench_backends [--size 100000] [--data ../shared/data] [--milvus-uri URI]
        [--kinds flat ivf_flat hnsw diskann]

A Milvus index the server does not build within ``--index-timeout`` (DISKANN on a server without
disk-index support) is reported as not built, and the run goes on.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from paraseek.core.rank_metrics import overlap_recall
from paraseek.index.faiss_index import IndexSpec, exact_search, set_threads
from paraseek.index.filters import SearchFilter
from paraseek.index.milvus_store import MilvusStore, stop_lite
from paraseek.index.snapshot import FaissStore
from paraseek.index.store import SnapshotStore
from paraseek.index.versions import BundleRef, SnapshotError, VersionDraft
from paraseek.loadtests import DEFAULT_DATA
from paraseek.loadtests.bench_index import synthetic_collection, synthetic_queries

REF = BundleRef(name="bench", version="1", image_space="clip-vit-b16/synthetic")
SELECTIVITY = {"1%": [0], "10%": list(range(10)), "50%": list(range(50))}  # licence ids 0..99 drawn uniformly
KINDS = {
    "flat": IndexSpec(type="flat"),
    "ivf_flat": IndexSpec(type="ivf_flat", nprobe=32),
    "hnsw": IndexSpec(type="hnsw", hnsw_m=32, ef_construction=200, ef_search=128),
}
# Milvus index types without a FAISS counterpart: the MilvusStore arguments that build them
MILVUS_ONLY: dict[str, dict[str, Any]] = {"diskann": {"index_type": "DISKANN", "search_params": {"search_list": 128}}}


def timed(fn, calls: int) -> float:
    """Median seconds per call."""
    fn()  # warm-up
    samples = []
    for _ in range(calls):
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


def measure(store: SnapshotStore, kind: str, vectors, ids, rows, queries, truth, filtered_truth, calls: int,
            settle_s: float = 6.0) -> dict:
    draft = VersionDraft(store.new_version_name(), vectors, ids, rows, {"kind": "synthetic"}, {})
    t0 = time.perf_counter()
    store.write_version(draft, REF, KINDS.get(kind, IndexSpec(type="flat")), queries=queries[:4], query_source="bench")
    built = time.perf_counter()
    build_s = built - t0
    snap = store.load()
    set_threads(1)
    _, got = snap.search_ids(queries, 10)
    out = {"build_s": build_s, "recall": overlap_recall(got, truth)}
    single = iter(range(10**9))
    out["b1_ms"] = timed(lambda: snap.search_ids(queries[next(single) % len(queries)][None], 10), calls) * 1000
    set_threads(None)
    out["b64_qps"] = 64 / timed(lambda: snap.search_ids(queries[:64], 10), max(5, calls // 10))
    out["short"] = 0
    for name, licences in SELECTIVITY.items():
        view = snap.filtered(SearchFilter(licence=licences))
        set_threads(1)
        _, got = view.search_ids(queries, 10)
        out[f"{name}_recall"] = overlap_recall(got, filtered_truth[name])
        out["short"] += int((got < 0).any(axis=1).sum())  # every filter keeps far more than 10
        out[f"{name}_ms"] = timed(lambda v=view: v.search_ids(queries[next(single) % len(queries)][None], 10), calls) * 1000
    snap.close()
    # a server reads the version once a start, a reload or a poll comes, usually long after the build: past
    # a Milvus server's bounded staleness (5 s), where the store's reads need not wait for a Strong read
    time.sleep(max(0.0, built + settle_s - time.perf_counter()))
    out["poll_ms"] = timed(store.current_version, 20) * 1000
    out["manifest_ms"] = timed(store.manifest, 20) * 1000
    if isinstance(store, MilvusStore):  # the server's memory goes to the next kind
        store.client.release_collection(store.collection(draft.version))
    return out


def main(argv: list[str] | None = None) -> dict[tuple[str, str], dict]:
    """Prints the table; returns the measurements by (backend, index kind)."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", type=int, default=100_000)
    p.add_argument("--data", type=Path, default=DEFAULT_DATA)
    p.add_argument("--milvus-uri", default=None, help="a Milvus server (default: Milvus Lite in a temporary folder)")
    p.add_argument("--kinds", nargs="+", default=list(KINDS), choices=[*KINDS, *MILVUS_ONLY])
    p.add_argument("--index-timeout", type=float, default=900.0, help="seconds a Milvus server may take to index a version")
    p.add_argument("--timeout", type=float, default=300.0,
                   help="seconds per Milvus call (the recall measurement sends all queries in one search)")
    p.add_argument("--calls", type=int, default=200, help="timed calls per batch-1 measurement")
    p.add_argument("--settle", type=float, default=6.0,
                   help="seconds from a version's publication to the timing of its reads (a server's staleness bound is 5)")
    args = p.parse_args(argv)

    feats = np.load(args.data / "clip-vitb16-coco500" / "features_clip.npy")
    rng = np.random.default_rng(0)
    vectors = synthetic_collection(feats[0].astype(np.float32), args.size, rng)
    queries = synthetic_queries(feats[1].astype(np.float32), rng=rng)
    ids = np.arange(args.size, dtype=np.int64) * 7 + 1
    licences = rng.integers(0, 100, args.size)
    rows = [{"id": int(i), "license": {"id": int(lic)}} for i, lic in zip(ids, licences)]
    truth = exact_search(vectors, ids, queries, 10)
    filtered_truth = {}
    for name, allowed in SELECTIVITY.items():
        keep = np.isin(licences, allowed)
        filtered_truth[name] = exact_search(vectors[keep], ids[keep], queries, 10)
        print(f"filter {name}: {keep.mean() * 100:.1f} % of the vectors match", flush=True)

    header = (f"{'backend':8} {'index':9} {'build s':>8} {'recall@10':>9} {'b1 p50 ms':>9} {'b64 QPS':>9} "
              + " ".join(f"{'f' + n + ' ms':>9} {'f' + n + ' rec':>9}" for n in SELECTIVITY) + f" {'short':>5} {'poll ms':>8} {'mfst ms':>8}")
    print(f"\n{args.size} vectors x {vectors.shape[1]}, {len(queries)} queries; batch 1 on one FAISS thread, batch 64 on all")
    print(header, flush=True)
    results: dict[tuple[str, str], dict] = {}
    with tempfile.TemporaryDirectory(prefix="bench-backends-") as tmp:
        lite = str(Path(tmp) / "milvus.db")
        try:
            for kind in args.kinds:
                for backend in ("milvus",) if kind in MILVUS_ONLY else ("faiss", "milvus"):
                    if backend == "faiss":
                        store: SnapshotStore = FaissStore(Path(tmp) / f"faiss-{kind}")
                    else:
                        store = MilvusStore(args.milvus_uri or lite, prefix=f"bench_{kind}",
                                            timeout_s=args.timeout, index_timeout_s=args.index_timeout, **MILVUS_ONLY.get(kind, {}))
                    try:
                        r = results[(backend, kind)] = measure(store, kind, vectors, ids, rows, queries, truth, filtered_truth,
                                                               args.calls, args.settle)
                    except SnapshotError as exc:
                        print(f"{backend:8} {kind:9} not built: {exc}", flush=True)
                        continue
                    finally:
                        store.close()
                    line = (f"{backend:8} {kind:9} {r['build_s']:8.2f} {r['recall']:9.3f} {r['b1_ms']:9.2f} {r['b64_qps']:9.0f} "
                            + " ".join(f"{r[n + '_ms']:9.2f} {r[n + '_recall']:9.3f}" for n in SELECTIVITY)
                            + f" {r['short']:5d} {r['poll_ms']:8.2f} {r['manifest_ms']:8.2f}")
                    print(line, flush=True)
        finally:
            stop_lite(lite)  # before its folder goes, whether or not every kind was measured
    print("\nMilvus / FAISS, same index kind (time ratios: > 1 means Milvus is slower; QPS ratio: < 1 means Milvus is slower)")
    print(f"{'index':9} {'build':>7} {'b1 p50':>7} {'b64 QPS':>8} " + " ".join(f"{'f' + n:>7}" for n in SELECTIVITY)
          + f" {'poll':>7} {'mfst':>7}")
    for kind in args.kinds:
        if ("faiss", kind) not in results or ("milvus", kind) not in results:
            continue
        f, m = results[("faiss", kind)], results[("milvus", kind)]
        print(f"{kind:9} {m['build_s'] / f['build_s']:7.1f} {m['b1_ms'] / f['b1_ms']:7.1f} {m['b64_qps'] / f['b64_qps']:8.2f} "
              + " ".join(f"{m[n + '_ms'] / f[n + '_ms']:7.1f}" for n in SELECTIVITY)
              + f" {m['poll_ms'] / f['poll_ms']:7.1f} {m['manifest_ms'] / f['manifest_ms']:7.1f}")
    return results


if __name__ == "__main__":
    main()
