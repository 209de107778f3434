"""Bring your own embeddings: precomputed vectors, clip-retrieval's layout, export and back."""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from paraseek.index.builder import build_snapshot_from_vectors, export_snapshot_vectors
from paraseek.index.versions import BuildError
from paraseek.index.faiss_index import IndexSpec
from paraseek.index.snapshot import Snapshot, current_version
from paraseek.index.vector_sources import VectorSourceError
from paraseek.cli import app

SPACE = "test/space"
runner = CliRunner()


def unit_rows(rng, n, dim=16):
    v = rng.normal(size=(n, dim)).astype(np.float32)
    return v / np.linalg.norm(v, axis=1, keepdims=True)


def write_shards(folder: Path, sizes=(40, 35, 25), dim=16, seed=0, first_id=1000) -> np.ndarray:
    """.npy shards with JSON-lines metadata beside them (id, caption, url, licence, a user field)."""
    rng = np.random.default_rng(seed)
    folder.mkdir(parents=True, exist_ok=True)
    image_id, all_vectors = first_id, []
    for number, size in enumerate(sizes):
        vectors = unit_rows(rng, size, dim)
        np.save(folder / f"part_{number:03d}.npy", vectors)
        with open(folder / f"part_{number:03d}.jsonl", "w") as f:
            for _ in range(size):
                f.write(json.dumps({"id": image_id, "caption": f"photo {image_id}", "url": f"https://x/{image_id}.jpg",
                                    "license": "CC BY 2.0", "camera": f"cam{image_id % 3}"}) + "\n")
                image_id += 1
        all_vectors.append(vectors)
    return np.concatenate(all_vectors)


@pytest.mark.quick
def test_shards_build_a_searchable_snapshot(tmp_path):
    vectors = write_shards(tmp_path / "emb")
    result = build_snapshot_from_vectors(tmp_path / "emb", tmp_path / "snap", image_space=SPACE, progress=False)
    snap = Snapshot.load(tmp_path / "snap", image_space=SPACE)
    assert len(snap) == 100 and result.manifest.image_space == SPACE and result.manifest.dim == 16
    hits = snap.search(vectors[41:42], 1)[0]
    assert hits[0].id == 1041  # row 1 of the second shard
    meta = snap.metadata[1041]
    assert meta["captions"] == ["photo 1041"] and meta["url"] == "https://x/1041.jpg"
    assert meta["license"] == {"name": "CC BY 2.0"} and meta["fields"] == {"camera": "cam0"}
    with pytest.raises(Exception, match="image space"):
        Snapshot.load(tmp_path / "snap", image_space="another/space")


@pytest.mark.quick
def test_export_then_build_gives_identical_results(tmp_path):
    write_shards(tmp_path / "emb", sizes=(60, 60))
    build_snapshot_from_vectors(tmp_path / "emb", tmp_path / "a", image_space=SPACE, progress=False,
                                spec=IndexSpec(type="ivf_flat", nlist=4, nprobe=4))
    export_snapshot_vectors(tmp_path / "a", tmp_path / "out", shard_size=50, progress=False)
    assert sorted(p.name for p in (tmp_path / "out/img_emb").iterdir()) == ["img_emb_0.npy", "img_emb_1.npy", "img_emb_2.npy"]
    r = runner.invoke(app, ["index", "build", "--embeddings", str(tmp_path / "out"), "--image-space", SPACE,
                            "--out", str(tmp_path / "b"), "--type", "ivf_flat", "--params", '{"nlist": 4, "nprobe": 4}'])
    assert r.exit_code == 0, r.output
    a, b = Snapshot.load(tmp_path / "a"), Snapshot.load(tmp_path / "b")
    queries = unit_rows(np.random.default_rng(7), 20)
    (sa, ia), (sb, ib) = a.search_ids(queries, 10), b.search_ids(queries, 10)
    np.testing.assert_array_equal(ia, ib)
    np.testing.assert_allclose(sa, sb, atol=1e-6)
    assert b.metadata[1005] == a.metadata[1005]  # metadata makes the round trip too


@pytest.mark.quick
def test_clip_retrieval_layout_is_read_as_it_is(tmp_path):
    """img_emb/img_emb_{i}.npy + metadata/metadata_{i}.parquet, the columns clip-retrieval writes."""
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    rng = np.random.default_rng(3)
    (tmp_path / "cr/img_emb").mkdir(parents=True)
    (tmp_path / "cr/metadata").mkdir()
    for shard, keys in enumerate([["000000001", "000000002", "000000003"], ["000010000", "000010001"]]):
        np.save(tmp_path / f"cr/img_emb/img_emb_{shard}.npy", unit_rows(rng, len(keys), 8).astype(np.float16))
        table = pa.Table.from_pylist([
            {"image_path": f"{k}.jpg", "caption": f"caption {k}", "NSFW": "UNLIKELY", "similarity": 0.31,
             "LICENSE": "?", "url": f"http://img/{k}.jpg", "key": k, "status": "success", "error_message": None,
             "width": 256, "height": 256, "original_width": 640, "original_height": 480, "exif": "{}", "md5": "ab"}
            for k in keys])
        pq.write_table(table, tmp_path / f"cr/metadata/metadata_{shard}.parquet")
    result = build_snapshot_from_vectors(tmp_path / "cr", tmp_path / "snap", image_space=SPACE, progress=False)
    snap = Snapshot.load(tmp_path / "snap")
    assert result.manifest.source["kind"] == "vectors:clip-retrieval"
    assert sorted(snap.ids.tolist()) == [1, 2, 3, 10000, 10001]  # img2dataset keys as ids
    row = snap.metadata[10001]
    assert row["path"] == "000010001.jpg" and row["captions"] == ["caption 000010001"] and row["url"] == "http://img/000010001.jpg"
    assert row["fields"]["NSFW"] == "UNLIKELY" and row["fields"]["original_width"] == 640


@pytest.mark.parametrize("breakage, message", [
    ("dimension", "shard part_001.npy: dimension 8, but part_000.npy has 16"),
    ("nan", "shard part_001.npy row 7: NaN"),
    ("zero", "shard part_000.npy row 3: an all-zero vector"),
    ("duplicate", "shard part_002.npy row 4: id 1010 already used in shard part_000.npy row 10"),
    ("missing row", "shard part_001.npy: 35 vectors but 34 metadata rows"),
    ("norm", "shard part_000.npy row 0: norm 2.0000"),
])
@pytest.mark.quick
def test_bad_shards_name_shard_and_row_and_leave_current(tmp_path, breakage, message):
    write_shards(tmp_path / "emb")
    build_snapshot_from_vectors(tmp_path / "emb", tmp_path / "snap", image_space=SPACE, progress=False)
    before = current_version(tmp_path / "snap")
    rng = np.random.default_rng(1)
    if breakage == "dimension":
        np.save(tmp_path / "emb/part_001.npy", unit_rows(rng, 35, 8))
    elif breakage in ("nan", "zero", "norm"):
        shard = "part_001" if breakage == "nan" else "part_000"
        v = np.load(tmp_path / f"emb/{shard}.npy")
        row = {"nan": 7, "zero": 3, "norm": 0}[breakage]
        v[row] = {"nan": np.nan, "zero": 0.0, "norm": v[row] * 2}[breakage]
        np.save(tmp_path / f"emb/{shard}.npy", v)
    elif breakage == "duplicate":
        lines = (tmp_path / "emb/part_002.jsonl").read_text().splitlines()
        row = json.loads(lines[4])
        row["id"] = 1010
        lines[4] = json.dumps(row)
        (tmp_path / "emb/part_002.jsonl").write_text("\n".join(lines) + "\n")
    else:
        lines = (tmp_path / "emb/part_001.jsonl").read_text().splitlines()
        (tmp_path / "emb/part_001.jsonl").write_text("\n".join(lines[:-1]) + "\n")
    with pytest.raises((VectorSourceError, BuildError), match=message.replace("(", r"\(")):
        build_snapshot_from_vectors(tmp_path / "emb", tmp_path / "snap", image_space=SPACE, progress=False)
    assert current_version(tmp_path / "snap") == before
    assert len(list((tmp_path / "snap/versions").iterdir())) == 1  # nothing half-written stays behind
    r = runner.invoke(app, ["index", "build", "--embeddings", str(tmp_path / "emb"), "--image-space", SPACE,
                            "--out", str(tmp_path / "snap")])
    assert r.exit_code == 2 and message.split(":")[0] in r.output and "Traceback" not in r.output


@pytest.mark.quick
def test_normalize_flag_accepts_unnormalised_vectors(tmp_path):
    rng = np.random.default_rng(0)
    np.save(tmp_path / "v.npy", rng.normal(size=(30, 16)).astype(np.float32) * 3)
    with pytest.raises(VectorSourceError, match="--normalize"):
        build_snapshot_from_vectors(tmp_path / "v.npy", tmp_path / "snap", image_space=SPACE, progress=False)
    build_snapshot_from_vectors(tmp_path / "v.npy", tmp_path / "snap", image_space=SPACE, normalize=True, progress=False)
    stored = Snapshot.load(tmp_path / "snap").vectors()
    np.testing.assert_allclose(np.linalg.norm(stored, axis=1), 1, atol=1e-5)
    assert Snapshot.load(tmp_path / "snap").ids.tolist() == list(range(30))  # no metadata: row numbers


@pytest.mark.quick
def test_cli_needs_one_source_and_an_image_space(tmp_path, monkeypatch):
    monkeypatch.setenv("PARASEEK_HOME", str(tmp_path / "home"))
    write_shards(tmp_path / "emb")
    r = runner.invoke(app, ["index", "build", str(tmp_path), "--embeddings", str(tmp_path / "emb")])
    assert r.exit_code == 2 and "one of the two" in r.output
    r = runner.invoke(app, ["index", "build", "--embeddings", str(tmp_path / "nothing"), "--image-space", SPACE])
    assert r.exit_code == 2 and "do not exist" in r.output
    # no --image-space: the configured bundle's image tower names it, and a missing bundle says so
    r = runner.invoke(app, ["index", "build", "--embeddings", str(tmp_path / "emb")])
    assert r.exit_code == 2 and "starter-robust is not a directory" in r.output


MEMORY_CAPPED_BUILD = """
import mmap, resource, sys
import numpy as np
from paraseek.index.builder import build_snapshot_from_vectors
from paraseek.index.faiss_index import IndexSpec
import faiss
# BLAS sets up its buffers on first use and crashes rather than raises when that fails: warm it up first
faiss.Kmeans(256, 64, niter=2).train(np.random.default_rng(0).random((64 * 39, 256), dtype=np.float32))
# RLIMIT_DATA counts heap and private memory, not mapped files: the build may allocate `headroom` bytes
# beyond what the idle interpreter with numpy and faiss loaded already holds
idle = next(int(line.split()[1]) * 1024 for line in open("/proc/self/status") if line.startswith("VmData:"))
headroom = int(sys.argv[2])
resource.setrlimit(resource.RLIMIT_DATA, (idle + headroom, idle + headroom))
result = build_snapshot_from_vectors(sys.argv[1], sys.argv[1] + "-snap", image_space="test/space", progress=False,
                                     train_sample=20_000, chunk=16_384,
                                     spec=IndexSpec(type="ivf_pq", nlist=64, pq_m=16, nprobe=8))
print(result.manifest.count, result.manifest.recall_at_10)
"""


def test_build_from_shards_larger_than_the_memory_cap(tmp_path):
    """8 shards of 40,000 x 256 float32 (328 MB in all) indexed with 200 MB of memory to spare."""
    rng = np.random.default_rng(0)
    folder = tmp_path / "big"
    folder.mkdir()
    for shard in range(8):
        v = rng.standard_normal((40_000, 256), dtype=np.float32)
        v /= np.linalg.norm(v, axis=1, keepdims=True)
        np.save(folder / f"emb_{shard}.npy", v)
        del v
    total = sum(p.stat().st_size for p in folder.glob("*.npy"))
    headroom = 200 * 2**20
    assert total > headroom * 1.5
    # one thread and one malloc arena: each OpenMP thread's stack and arena would count against the cap
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MALLOC_ARENA_MAX": "1"}
    done = subprocess.run([sys.executable, "-c", MEMORY_CAPPED_BUILD, str(folder), str(headroom)],
                          capture_output=True, text=True, timeout=600, env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    count, recall = done.stdout.split()
    assert int(count) == 320_000 and float(recall) > 0
    # the same build with too little headroom fails: the cap is real
    starved = subprocess.run([sys.executable, "-c", MEMORY_CAPPED_BUILD, str(folder), str(20 * 2**20)],
                             capture_output=True, text=True, timeout=600, env=env)
    assert starved.returncode != 0 and "MemoryError" in starved.stderr


@pytest.mark.quick
def test_metadata_values_are_typed_at_build_or_refused_naming_shard_row_and_field(tmp_path):
    from paraseek.index.metadata_fields import MetadataFieldError

    rng = np.random.default_rng(3)
    folder = tmp_path / "emb"
    folder.mkdir()
    np.save(folder / "part_000.npy", unit_rows(rng, 3))
    rows = [{"id": 1, "caption": 17, "url": "https://x/1.jpg", "license": {"id": "4", "name": 5, "url": None}},
            {"id": 2, "captions": ["a", 2.5], "license": 7},
            {"id": 3, "url": {"href": "https://x/3.jpg"}}]
    (folder / "part_000.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(MetadataFieldError, match=r"part_000\.jsonl row 2: url: text expected, got dict"):
        build_snapshot_from_vectors(folder, tmp_path / "snap", image_space=SPACE, progress=False)
    refused = runner.invoke(app, ["index", "build", "--embeddings", str(folder), "--image-space", SPACE,
                                  "--out", str(tmp_path / "snap")])
    assert refused.exit_code == 2 and "part_000.jsonl row 2: url" in refused.output
    assert current_version(tmp_path / "snap") is None  # nothing published
    rows[2]["url"] = "https://x/3.jpg"
    (folder / "part_000.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    build_snapshot_from_vectors(folder, tmp_path / "snap", image_space=SPACE, progress=False)
    meta = Snapshot.load(tmp_path / "snap", image_space=SPACE).metadata
    assert meta[1]["captions"] == ["17"] and meta[1]["license"] == {"id": 4, "name": "5"}
    assert meta[2]["captions"] == ["a", "2.5"] and meta[2]["license"] == {"name": "7"}
