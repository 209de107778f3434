"""IVF snapshots served from a read-only memory map of their index file: the same answers as an index
copied into memory, with the lists in page cache rather than the process's private memory."""

import json
import subprocess
import sys

import faiss
import numpy as np
import pytest

from paraseek.index.builder import build_snapshot_from_vectors
from paraseek.index.faiss_index import IndexSpec
from paraseek.index.filters import SearchFilter
from paraseek.index.snapshot import FaissStore, Snapshot, resolve
from paraseek.index.versions import SnapshotError

SPACE = "test/space"


def clustered(n, dim, seed=0):
    rng = np.random.default_rng(seed)
    centres = rng.normal(size=(64, dim)).astype(np.float32)
    v = centres[rng.integers(0, 64, n)] + 0.5 * rng.normal(size=(n, dim)).astype(np.float32)
    return v / np.linalg.norm(v, axis=1, keepdims=True)


def build(tmp_path, kind, n=4000, dim=32, first_id=500, metadata=True):
    folder = tmp_path / "emb"
    folder.mkdir()
    np.save(folder / "part_000.npy", clustered(n, dim))
    if metadata:
        with open(folder / "part_000.jsonl", "w") as f:
            for i in range(n):
                f.write(json.dumps({"id": first_id + 3 * i, "caption": f"photo {i}", "camera": f"cam{i % 4}"}) + "\n")
    root = tmp_path / "snap"
    build_snapshot_from_vectors(folder, root, image_space=SPACE, progress=False,
                                spec=IndexSpec(type=kind, nlist=32, nprobe=8, pq_m=8))
    return root


@pytest.mark.parametrize("kind", ["ivf_flat", "ivf_fp16", "ivf_pq"])
def test_memory_mapped_ivf_answers_as_the_copy_in_memory(tmp_path, kind):
    root = build(tmp_path, kind)
    mapped, copied = Snapshot.load(root), Snapshot.load(root, memory_map=False)
    assert mapped.memory_mapped and not copied.memory_mapped
    assert isinstance(mapped.index, faiss.IndexIVF)  # ids live in the lists: no IndexIDMap2 and its maps
    queries = clustered(20, 32, seed=1)
    for a, b in [(mapped.search_ids(queries, 10), copied.search_ids(queries, 10)),
                 (mapped.search_ids(queries[:1], 5), copied.search_ids(queries[:1], 5))]:
        np.testing.assert_array_equal(a[1], b[1])
        np.testing.assert_allclose(a[0], b[0], rtol=1e-5)
    # a filter runs through the read-only index with an id selector, and only matching ids come back
    flt = SearchFilter.model_validate({"fields": {"camera": "cam1"}})
    mapped_view, copied_view = mapped.filtered(flt), copied.filtered(flt)
    # more matches than an exact scan of the matching rows takes: the ANN index is searched with a selector
    assert len(mapped_view) == 1000
    scores, ids = mapped_view.search_ids(queries, 10)
    assert all(mapped.metadata[int(i)]["fields"]["camera"] == "cam1" for i in ids.ravel() if i >= 0)
    np.testing.assert_array_equal(ids, copied_view.search_ids(queries, 10)[1])
    assert mapped.metadata_of(ids[0])[int(ids[0, 0])]["captions"][0].startswith("photo")


def test_the_store_follows_the_setting(tmp_path):
    root = build(tmp_path, "ivf_flat")
    assert FaissStore(root).load().memory_mapped
    assert not FaissStore(root, memory_map=False).load().memory_mapped
    (tmp_path / "flat").mkdir()
    flat = build(tmp_path / "flat", "flat")
    assert FaissStore(flat).load().memory_mapped  # a flat index's vectors too
    assert not FaissStore(flat, memory_map=False).load().memory_mapped
    (tmp_path / "hnsw").mkdir()
    assert not FaissStore(build(tmp_path / "hnsw", "hnsw")).load().memory_mapped  # a graph is held in memory


@pytest.mark.quick
def test_a_snapshot_of_the_older_layout_still_loads(tmp_path):
    """IVF snapshots written before this release wrap the index in IndexIDMap2."""
    root = build(tmp_path, "ivf_flat")
    version = resolve(root)
    before = Snapshot.load(root).search_ids(clustered(5, 32, seed=2), 10)
    bare = faiss.read_index(str(version / "index.faiss"))
    empty = faiss.clone_index(bare)
    empty.reset()
    wrapped = faiss.IndexIDMap2(empty)
    wrapped.add_with_ids(np.load(version / "vectors.npy"), np.load(version / "ids.npy"))
    faiss.write_index(wrapped, str(version / "index.faiss"))
    manifest = json.loads((version / "manifest.json").read_text())
    del manifest["user_fields"]  # and their manifests name no user fields
    (version / "manifest.json").write_text(json.dumps(manifest))
    old = Snapshot.load(root, verify=False)
    assert old.memory_mapped and old.user_fields == ["camera"]
    after = old.search_ids(clustered(5, 32, seed=2), 10)
    np.testing.assert_array_equal(before[1], after[1])


@pytest.mark.quick
def test_metadata_that_disagrees_with_the_ids_is_refused_at_load(tmp_path):
    root = build(tmp_path, "ivf_flat", n=300)
    path = resolve(root) / "metadata.jsonl"
    lines = path.read_text().splitlines(keepends=True)
    path.write_text("".join(lines[:-1]))
    with pytest.raises(SnapshotError, match="299 rows, ids.npy 300"):
        Snapshot.load(root, verify=False)
    path.write_text("".join([lines[1], lines[0], *lines[2:]]))
    with pytest.raises(SnapshotError, match="row 0 is not the row of id 500"):
        Snapshot.load(root, verify=False)


MEASURE = """
import sys
import numpy as np
from paraseek.core.memory import process_memory
from paraseek.index.snapshot import Snapshot
queries = np.load(sys.argv[3])
np.ones(1) @ np.ones(1)  # BLAS and faiss' own buffers set up before the first reading
before = process_memory()
snap = Snapshot.load(sys.argv[1], memory_map=sys.argv[2] == "mapped", verify=False)
if hasattr(snap.index, "nprobe"):
    snap.index.nprobe = snap.index.nlist  # every list read: every page of the index file touched
snap.search_ids(queries, 10)
after = process_memory()
print(after.private_mb - before.private_mb, after.file_mb - before.file_mb)
"""


@pytest.mark.parametrize("kind", ["ivf_flat", "flat"])
def test_memory_mapped_lists_are_page_cache_not_private_memory(tmp_path, kind):
    """60K x 256: 61 MB of IVF lists (searched with every list probed) or of flat vectors."""
    root = build(tmp_path, kind, n=60_000, dim=256, metadata=False)
    lists_mb = (resolve(root) / "index.faiss").stat().st_size / 2**20
    assert lists_mb > 55
    np.save(tmp_path / "q.npy", clustered(64, 256, seed=3))
    grown = {}
    for mode in ("mapped", "copied"):
        done = subprocess.run([sys.executable, "-c", MEASURE, str(root), mode, str(tmp_path / "q.npy")],
                              capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-2000:]
        grown[mode] = [float(x) for x in done.stdout.split()]
    (mapped_private, mapped_file), (copied_private, _) = grown["mapped"], grown["copied"]
    assert copied_private > 0.9 * lists_mb  # the copy is private memory
    assert mapped_private < 0.25 * lists_mb  # ids and line offsets (0.5 MB each) and search buffers only
    assert mapped_file > 0.9 * lists_mb  # the lists were read, from the file's pages
