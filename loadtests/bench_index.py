"""Index benchmark, one run, medians:

1. build throughput (images/s) of `paraseek index build` on the COCO-mini photos with the starter, with its
   3 x 3 crops and without them (`--crop-grid 0`);
2. search latency and QPS at batch 1 and 64 for flat, HNSW and IVF at 10K, 100K and 1M vectors, with
   recall@10 against exact search, and each index's speed-up over exact at the same batch size.

Synthetic collections are drawn around real embedding clusters, not plain Gaussian noise: each vector
is a random mix of two of the 500 real CLIP ViT-B/16 COCO image embeddings plus noise, normalised
(noise 0.35: cosine ~0.9 to the mix of the two). Queries are the 500 real
caption embeddings with a little noise.

    python -m paraseek.loadtests.bench_index [--sizes 10000 100000 1000000] [--data ../shared/data]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

import numpy as np

from paraseek.core.encoder import Encoder
from paraseek.core.rank_metrics import overlap_recall
from paraseek.index.builder import build_snapshot
from paraseek.index.faiss_index import (
    IVF_TYPES,
    ExactVectors,
    IndexSpec,
    apply_search_params,
    create_index,
    exact_search,
    search,
    set_threads,
    train_and_add,
    tune_for_recall,
)
from paraseek.loadtests import DEFAULT_DATA, temporary_folder


def synthetic_collection(centres: np.ndarray, n: int, rng: np.random.Generator, noise: float = 0.35) -> np.ndarray:
    out = np.empty((n, centres.shape[1]), np.float32)
    step = 100_000
    for start in range(0, n, step):
        m = min(step, n - start)
        i, j = rng.integers(0, len(centres), m), rng.integers(0, len(centres), m)
        a = rng.uniform(0.5, 1.0, (m, 1)).astype(np.float32)
        g = rng.standard_normal((m, centres.shape[1])).astype(np.float32) / np.sqrt(centres.shape[1])
        v = a * centres[i] + (1 - a) * centres[j] + noise * g
        out[start : start + m] = v / np.linalg.norm(v, axis=1, keepdims=True)
    return out


def write_synthetic_shards(folder: Path, count: int, per_shard: int, centres: np.ndarray) -> int:
    """``count`` vectors of ``synthetic_collection`` around ``centres`` in .npy shards of ``per_shard``
    rows (``emb_0000.npy``, ...), one seeded stream across them; returns the bytes written."""
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    for number, start in enumerate(range(0, count, per_shard)):
        np.save(folder / f"emb_{number:04d}.npy", synthetic_collection(centres, min(per_shard, count - start), rng))
    return sum(p.stat().st_size for p in folder.glob("*.npy"))


def synthetic_queries(texts: np.ndarray, seed: int = 0, rng: np.random.Generator | None = None) -> np.ndarray:
    """The 500 real caption embeddings with a little noise, normalised: text queries, which sit away
    from the image vectors the collection is drawn around."""
    rng = rng or np.random.default_rng(seed)
    qn = texts + 0.1 * rng.standard_normal(texts.shape).astype(np.float32) / np.sqrt(texts.shape[1])
    return np.ascontiguousarray(qn / np.linalg.norm(qn, axis=1, keepdims=True))


def time_search(index, queries: np.ndarray, batch: int, k: int = 10, budget_s: float = 1.5) -> tuple[float, float]:
    """-> (median latency ms per call, queries/s). ``paraseek.index``: anything with ``search(queries, k)``."""
    index.search(queries[:batch], k)  # warm-up
    lat: list[float] = []
    done, start = 0, time.perf_counter()
    while time.perf_counter() - start < budget_s or len(lat) < 5:
        q = queries[(done % len(queries)) : (done % len(queries)) + batch]
        if len(q) < batch:
            q = queries[:batch]
        t0 = time.perf_counter()
        index.search(q, k)
        lat.append(time.perf_counter() - t0)
        done += batch
        if len(lat) >= 2000:
            break
    return statistics.median(lat) * 1000, batch / statistics.median(lat)


def build_throughput(data: Path, repeats: int = 3) -> tuple[float, float]:
    """Images/s of a snapshot build over the 159 COCO-mini val photos with the starter as shipped (the
    whole photo and 3 x 3 crops) and without crops (``--crop-grid 0``), builds alternating, medians."""
    from paraseek.training.export.starter import build_starter  # torch, lazily: only this row needs it
    from paraseek.training.export.starter_release import CROP_GRID

    tmp = temporary_folder("paraseek-bench-index-")
    rates: dict[int, list[float]] = {CROP_GRID: [], 0: []}
    encoders = {}
    for grid in rates:
        build_starter(tmp / f"starter-{grid}", int8=False, crop_grid=grid)
        encoders[grid] = Encoder(tmp / f"starter-{grid}")
    for i in range(repeats):
        for grid, enc in encoders.items():
            res = build_snapshot(data / "coco-mini" / "captions_val2017.json", enc, tmp / f"snap-{grid}-{i}", progress=False)
            rates[grid].append(res.images_per_second)
    return statistics.median(rates[CROP_GRID]), statistics.median(rates[0])  # (as shipped, whole photo only)


def operating_points(spec: IndexSpec) -> list[tuple[str, IndexSpec]]:
    """Search-time settings to report for one built index (recall/speed trade-off)."""
    if spec.type == "hnsw":
        return [(f"efSearch={ef}", spec.model_copy(update={"ef_search": ef})) for ef in (64, 128, 256, 512)]
    if spec.type in IVF_TYPES:
        assert spec.nlist is not None  # resolved() set it
        probes = sorted({max(1, spec.nlist // d) for d in (128, 64, 32, 16, 8)})
        if spec.type == "ivf_pq":  # PQ codes alone, then re-ranked by the exact vectors (refine)
            return [(f"nprobe={p} rf={r}", spec.model_copy(update={"nprobe": p, "refine_factor": r}))
                    for r in (1, 10, 20, 50) for p in probes]
        return [(f"nprobe={p}", spec.model_copy(update={"nprobe": p})) for p in probes]
    return [("exact", spec)]


class Searcher:
    """One index at one search setting, through the refine stage when the setting has one."""

    def __init__(self, index, spec: IndexSpec, exact: ExactVectors):
        self.index, self.spec, self.exact = index, spec, exact

    def search(self, queries: np.ndarray, k: int):
        return search(self.index, self.spec, queries, k, self.exact)


def specs_for(n: int) -> dict[str, IndexSpec]:
    nlist = int(4 * np.sqrt(n))
    return {
        "flat": IndexSpec(type="flat"),
        # HNSW construction dominates at 1M on two cores: a cheaper build there
        "hnsw": IndexSpec(type="hnsw", hnsw_m=32, ef_construction=80 if n <= 100_000 else 64),
        "ivf_flat": IndexSpec(type="ivf_flat", nlist=nlist),
        "ivf_fp16": IndexSpec(type="ivf_fp16", nlist=nlist),
        "ivf_pq": IndexSpec(type="ivf_pq", nlist=nlist, pq_nbits=8),  # pq_m: the default, dim/4
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", type=int, nargs="+", default=[10_000, 100_000, 1_000_000])
    p.add_argument("--kinds", nargs="+", default=["flat", "hnsw", "ivf_flat", "ivf_fp16", "ivf_pq"])
    p.add_argument("--data", type=Path, default=DEFAULT_DATA)
    p.add_argument("--threads", type=int, default=0, help="FAISS threads (0: all cores)")
    p.add_argument("--skip-build", action="store_true")
    args = p.parse_args(argv)

    if not args.skip_build:
        shipped, whole = build_throughput(args.data)
        print(f"build throughput (COCO-mini val, starter bundle, median of 3): {shipped:.1f} images/s with 3 x 3 crops, "
              f"{whole:.1f} without (--crop-grid 0): {whole / shipped:.1f}x", flush=True)

    feats = np.load(args.data / "clip-vitb16-coco500" / "features_clip.npy")
    centres, texts = feats[0].astype(np.float32), feats[1].astype(np.float32)
    rng = np.random.default_rng(0)
    queries = synthetic_queries(texts, rng=rng)
    set_threads(args.threads or None)

    print("batch 1 runs on 1 FAISS thread (fastest here for single queries), batch 64 on all threads")
    print(f"\n{'size':>8} {'index':9} {'search param':>14} {'build s':>8} {'recall@10':>9} {'b1 ms':>8} {'b1 QPS':>9} "
          f"{'b64 ms':>8} {'b64 QPS':>9} {'x exact b1':>10} {'x exact b64':>11}", flush=True)
    best: dict[str, float] = {}
    for n in args.sizes:
        vectors = synthetic_collection(centres, n, rng)
        ids = np.arange(n, dtype=np.int64)
        set_threads(args.threads or os.cpu_count())
        truth = exact_search(vectors, ids, queries, 10)
        exact_times: tuple[float, float] | None = None
        for kind in args.kinds:
            spec = specs_for(n)[kind].resolved(n, vectors.shape[1])
            set_threads(args.threads or os.cpu_count())
            t0 = time.perf_counter()
            index = create_index(spec, vectors.shape[1])
            if not index.is_trained:  # quantisers train on a sample, as snapshot builds do
                index.train(vectors[np.sort(rng.choice(n, min(n, 100_000), replace=False))])
            index = train_and_add(index, vectors, ids)
            build_s = time.perf_counter() - t0
            exact = ExactVectors(vectors, ids)
            points = operating_points(spec)
            if kind != "flat":  # and the setting --target-recall 0.95 picks, tuned on half the queries
                half = len(queries) // 2
                tuned, _, _ = tune_for_recall(index, spec, exact, queries[:half],
                                              truth[:half], 0.95)
                points.append(("tuned " + "/".join(f"{v}" for v in (tuned.nprobe if kind != "hnsw" else tuned.ef_search,
                                                                     tuned.refine_factor) if v), tuned))
            for label, point in points:
                apply_search_params(index, point)
                searcher = Searcher(index, point, exact)
                _, got = searcher.search(queries, 10)
                recall = overlap_recall(got, truth)
                set_threads(1)
                b1 = time_search(searcher, queries, 1)
                set_threads(args.threads or os.cpu_count())
                b64 = time_search(searcher, queries, 64)
                if kind == "flat":
                    exact_times = (b1[0], b64[0])
                assert exact_times is not None, "flat runs first: it is the reference"
                sx1, sx64 = exact_times[0] / b1[0], exact_times[1] / b64[0]
                print(f"{n:>8} {kind:9} {label:>14} {build_s:8.1f} {recall:9.3f} {b1[0]:8.3f} {b1[1]:9.0f} "
                      f"{b64[0]:8.2f} {b64[1]:9.0f} {sx1:10.1f} {sx64:11.1f}", flush=True)
                if n == max(args.sizes) and kind != "flat" and recall >= 0.95:
                    best[f"{kind} {label}"] = max(best.get(f"{kind} {label}", 0), sx1)
            del index
    if best:
        kind = max(best, key=lambda name: best[name])  # the fastest setting that reaches the recall target
        ok = best[kind] >= 50
        print(f"\ntarget at {max(args.sizes)}: approximate index with recall@10 >= 0.95 and >= 50x faster than exact (batch 1): "
              f"{kind} {best[kind]:.1f}x -> {'met' if ok else 'NOT met'}")
        return 0 if ok else 1
    print("\ntarget: no approximate index reached recall@10 >= 0.95 at the largest size -> NOT met")
    return 1


if __name__ == "__main__":
    raise SystemExit(main())
