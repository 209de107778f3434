"""Bring-your-own-embeddings benchmark, one run: build snapshots from precomputed vectors in .npy shards
(the synthetic mix of ``bench_index``, 1M x 512 by default) with ``build_snapshot_from_vectors``, flat
and IVF, each in a fresh process; print vectors/s, peak RSS, and the ratio of each build's time to the
time it takes just to read the shards from disk (the floor of any streamed build). Medians of
``--repeats`` runs.

    python -m paraseek.loadtests.bench_vectors [--count 1000000] [--shards 10] [--repeats 3] [--data ../shared/data]
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

from paraseek.loadtests import DEFAULT_DATA
from paraseek.loadtests.bench_index import write_synthetic_shards

BUILD = """
import json, resource, sys, time
from paraseek.index.builder import build_snapshot_from_vectors
from paraseek.index.faiss_index import IndexSpec
spec = IndexSpec.model_validate_json(sys.argv[3])
t0 = time.perf_counter()
result = build_snapshot_from_vectors(sys.argv[1], sys.argv[2], image_space="bench/space", spec=spec, progress=False)
seconds = time.perf_counter() - t0
print(json.dumps({"seconds": seconds, "recall": result.manifest.recall_at_10,
                  "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))
"""

READ = """
import json, resource, sys, time
from pathlib import Path
import numpy as np
t0 = time.perf_counter()
total = 0.0
for shard in sorted(Path(sys.argv[1]).glob("*.npy")):
    total += float(np.load(shard)[:, 0].sum())  # read every shard into memory, once
print(json.dumps({"seconds": time.perf_counter() - t0,
                  "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))
"""


def write_shards(folder: Path, count: int, shards: int, data: Path) -> int:
    feats = np.load(data / "clip-vitb16-coco500" / "features_clip.npy")
    return write_synthetic_shards(folder, count, -(-count // shards), feats[0].astype(np.float32))


WRITE = """
import json, sys
from pathlib import Path
from paraseek.loadtests.bench_vectors import write_shards
print(json.dumps({"bytes": write_shards(Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), Path(sys.argv[4]))}))
"""


def run(script: str, *args: str) -> dict:
    done = subprocess.run([sys.executable, "-c", script, *args], capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(done.stderr[-3000:])
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--count", type=int, default=1_000_000)
    p.add_argument("--shards", type=int, default=10)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--nlist", type=int, default=1024, help="IVF lists (trained on a 100K sample)")
    p.add_argument("--kinds", nargs="+", default=["flat", "ivf_flat", "ivf_pq"], choices=["flat", "ivf_flat", "ivf_pq"])
    p.add_argument("--data", type=Path, default=DEFAULT_DATA)
    args = p.parse_args(argv)
    specs = {"flat": {"type": "flat"}, "ivf_flat": {"type": "ivf_flat", "nlist": args.nlist, "nprobe": 32},
             "ivf_pq": {"type": "ivf_pq", "nlist": args.nlist, "nprobe": 32, "pq_m": 64}}
    with tempfile.TemporaryDirectory() as tmp:
        shards = Path(tmp) / "shards"
        shards.mkdir()
        # written by a child process: Linux carries a parent's peak RSS into the children it starts, so
        # this process stays small for the children's peaks to be their own
        size = run(WRITE, str(shards), str(args.count), str(args.shards), str(args.data))["bytes"]
        print(f"{args.count:,} vectors x 512 float32 in {args.shards} .npy shards ({size / 2**20:.0f} MB); "
              f"medians of {args.repeats} runs, each build in a fresh process", flush=True)
        reads = [run(READ, str(shards)) for _ in range(args.repeats)]
        read_s = statistics.median(r["seconds"] for r in reads)
        print(f"\n{'build':10} {'seconds':>8} {'vectors/s':>11} {'x read time':>11} {'peak RSS MB':>11} {'recall@10':>9}")
        print(f"{'read only':10} {read_s:8.2f} {args.count / read_s:11,.0f} {1.0:11.2f} "
              f"{statistics.median(r['peak_rss_mb'] for r in reads):11.0f} {'':>9}", flush=True)
        for name, spec in ((k, specs[k]) for k in args.kinds):
            rows = []
            for repeat in range(args.repeats):
                rows.append(run(BUILD, str(shards), str(Path(tmp) / f"snap-{name}-{repeat}"), json.dumps(spec)))
            seconds = statistics.median(r["seconds"] for r in rows)
            recall = rows[0]["recall"]
            print(f"{name:10} {seconds:8.2f} {args.count / seconds:11,.0f} {seconds / read_s:11.2f} "
                  f"{statistics.median(r['peak_rss_mb'] for r in rows):11.0f} {'exact' if recall is None else f'{recall:.3f}':>9}",
                  flush=True)
    print(f"\n(this process: peak RSS {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MB)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
