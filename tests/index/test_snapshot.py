"""Index snapshots on COCO-mini with the starter and the tiny open_clip bundle."""

import json
import shutil

import numpy as np
import pytest

from paraseek.index.builder import build_snapshot, update_snapshot
from paraseek.index.versions import BuildError
from paraseek.index.faiss_index import IndexSpec
from paraseek.index.snapshot import FILES, Snapshot, current_version, read_snapshot_manifest
from paraseek.index.versions import SnapshotError
from paraseek.index.image_sources import ImageSourceError, open_source
from paraseek.core.encoder import Encoder
from paraseek.core.integrity import VERIFIED


@pytest.fixture(scope="module")
def val_snapshot(starter_encoder, shared_data, tmp_path_factory):
    root = tmp_path_factory.mktemp("snap")
    result = build_snapshot(shared_data / "coco-mini/captions_val2017.json", starter_encoder, root, progress=False)
    return root, result


def test_build_publishes_current_with_manifest(val_snapshot, starter_encoder):
    root, result = val_snapshot
    m = result.manifest
    assert current_version(root) == m.version == result.version_dir.name
    assert m.count == 159 and m.dim == 384 and m.index.type == "flat"
    assert m.bundle.name == starter_encoder.name and m.image_space == starter_encoder.image_space
    assert set(m.files) == {"index.faiss", "ids.npy", "vectors.npy", "metadata.jsonl", "report.json"}
    assert result.skipped == []


@pytest.mark.quick
def test_metadata_carries_coco_fields(val_snapshot):
    snap = Snapshot.load(val_snapshot[0])
    row = snap.metadata[397133]
    assert row["coco_id"] == 397133 and len(row["captions"]) == 5
    assert row["license"]["id"] == 4 and row["flickr_url"].startswith("http")
    assert row["width"] == 640 and row["height"] == 427
    assert snap.image_path(397133).is_file()


def test_captions_find_their_photo(val_snapshot, starter_encoder, coco_val):
    _, captions, image_ids = coco_val
    snap = Snapshot.load(val_snapshot[0], image_space=starter_encoder.image_space)
    _, ids = snap.search_ids(starter_encoder.encode_text(captions), 10)
    r10 = (ids == image_ids[:, None]).any(1).mean()
    assert r10 >= 0.5, r10  # measured 0.745
    hits = snap.search(starter_encoder.encode_text(["a dog"]), 3)[0]
    assert [h.rank for h in hits] == [1, 2, 3] and hits[0].score >= hits[1].score >= hits[2].score


@pytest.mark.quick
def test_image_space_mismatch_refused(val_snapshot):
    with pytest.raises(SnapshotError, match="reindex with this bundle"):
        Snapshot.load(val_snapshot[0], image_space="open_clip/ViT-B-32/openai")


@pytest.mark.quick
def test_corrupt_snapshot_detected(val_snapshot, tmp_path):
    root = tmp_path / "copy"
    shutil.copytree(val_snapshot[0], root)
    version = root / "versions" / current_version(root)
    with open(version / "ids.npy", "r+b") as f:
        f.seek(-8, 2)
        f.write(b"\x00" * 8)
    with pytest.raises(SnapshotError, match="'ids.npy' does not match"):
        Snapshot.load(root)
    shutil.copy(val_snapshot[1].version_dir / "ids.npy", version / "ids.npy")
    Snapshot.load(root)  # restored: loads again
    (version / "metadata.jsonl").unlink()
    with pytest.raises(SnapshotError, match="'metadata.jsonl' is missing"):
        Snapshot.load(root)


@pytest.mark.quick
def test_a_load_hashes_only_what_changed_and_index_verify_hashes_everything(val_snapshot, tmp_path, monkeypatch):
    """Copied files are hashed once at their first load (new inodes), then taken as verified while
    unchanged; a change that keeps every stat field (bit rot) passes a load but not ``index verify``."""
    from typer.testing import CliRunner

    from paraseek.cli import app
    from paraseek.core import integrity

    root = tmp_path / "copy"
    shutil.copytree(val_snapshot[0], root)
    version = root / "versions" / current_version(root)
    hashed = []
    real = integrity.sha256_file
    monkeypatch.setattr(integrity, "sha256_file", lambda path: hashed.append(path.name) or real(path))
    monkeypatch.setattr(integrity, "RACY_NS", 0)  # the copy's files are seconds old
    Snapshot.load(root)
    assert sorted(hashed) == sorted(FILES)
    hashed.clear()
    Snapshot.load(root)
    assert hashed == []
    Snapshot.load(root, rehash=True)
    assert sorted(hashed) == sorted(FILES)
    # one flipped byte, the record then forged to match the file's stat: as if the disk had rotted it
    with open(version / "vectors.npy", "r+b") as f:  # the last vector's last byte: nothing else reads it at load
        f.seek(-1, 2)
        last = f.read(1)
        f.seek(-1, 2)
        f.write(bytes([last[0] ^ 1]))
    integrity.record_verified(version, read_snapshot_manifest(version).files)
    Snapshot.load(root)
    r = CliRunner().invoke(app, ["index", "verify", str(root)])
    assert r.exit_code != 0 and "'vectors.npy' does not match its sha256" in r.output
    shutil.copy(val_snapshot[1].version_dir / "vectors.npy", version / "vectors.npy")
    r = CliRunner().invoke(app, ["index", "verify", str(root)])
    assert r.exit_code == 0 and f"version {version.name}: matches its manifest" in r.output, r.output


@pytest.mark.quick
def test_bad_files_are_skipped_and_reported(starter_encoder, shared_data, tmp_path):
    src = tmp_path / "photos"
    (src / "sub").mkdir(parents=True)
    good = sorted((shared_data / "coco-mini/val2017").glob("*.jpg"))[:3]
    for p in good:
        shutil.copy(p, src / "sub" / p.name)
    (src / "truncated.jpg").write_bytes(good[0].read_bytes()[:2000])
    (src / "not-an-image.jpg").write_text("hello")
    (src / "empty.png").write_bytes(b"")
    with open(src / "video.mp4", "wb") as f:  # 20 GB (sparse): refused from its size, never read
        f.truncate(20 << 30)
    (src / "notes.bin").write_bytes(b"\x00" * (10 << 20))  # refused from its header, never held whole
    with open(src / "huge.jpg", "wb") as f:  # a JPEG header on 300 MB: refused from its size
        f.write(good[0].read_bytes()[:4096])
        f.truncate(300 << 20)
    root = tmp_path / "snap"
    result = build_snapshot(src, starter_encoder, root, progress=False)
    assert result.manifest.count == 3
    errors = {s["path"]: s["error"] for s in result.skipped}
    assert set(errors) == {"truncated.jpg", "not-an-image.jpg", "empty.png", "video.mp4", "huge.jpg", "notes.bin"}
    assert errors["notes.bin"] == errors["not-an-image.jpg"] == "not an image (no format Pillow reads starts it)"
    assert errors["video.mp4"] == f"{20 << 30} bytes, more than an image file may have ({256 << 20})"
    assert errors["huge.jpg"] == f"{300 << 20} bytes, more than an image file may have ({256 << 20})"
    report = json.loads((result.version_dir / "report.json").read_text())
    assert report["indexed"] == 3 and len(report["skipped"]) == 6
    # ids are stable across builds of the same folder
    again = build_snapshot(src, starter_encoder, root, progress=False)
    assert np.array_equal(np.sort(Snapshot.load(again.version_dir).ids), np.sort(Snapshot.load(result.version_dir).ids))


@pytest.mark.quick
def test_empty_and_undecodable_sources(starter_encoder, tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(ImageSourceError, match="contains no images"):
        build_snapshot(tmp_path / "empty", starter_encoder, tmp_path / "s", progress=False)
    with pytest.raises(ImageSourceError, match="does not exist"):
        open_source(tmp_path / "nope")
    (tmp_path / "junk").mkdir()
    (tmp_path / "junk" / "a.jpg").write_text("x")
    with pytest.raises(BuildError, match="could be decoded"):
        build_snapshot(tmp_path / "junk", starter_encoder, tmp_path / "s", progress=False)
    assert current_version(tmp_path / "s") is None
    versions = tmp_path / "s" / "versions"
    assert not versions.exists() or not any(versions.iterdir())  # no half-written version left


def test_interrupted_build_leaves_current_unchanged(val_snapshot, starter_encoder, shared_data, tmp_path, monkeypatch):
    root = tmp_path / "snap"
    shutil.copytree(val_snapshot[0], root)
    before = current_version(root)
    calls = {"n": 0}
    real = Encoder.encode_pixels

    def dies_midway(self, pixels):
        calls["n"] += 1
        if calls["n"] == 2:
            raise KeyboardInterrupt  # e.g. the user presses Ctrl-C during the build
        return real(self, pixels)

    monkeypatch.setattr(Encoder, "encode_pixels", dies_midway)
    with pytest.raises(KeyboardInterrupt):  # every photo encoded again (else the unchanged ones are reused)
        build_snapshot(shared_data / "coco-mini/captions_val2017.json", starter_encoder, root, progress=False, reuse=False)
    assert current_version(root) == before
    assert [p.name for p in (root / "versions").iterdir()] == [before]
    Snapshot.load(root)


@pytest.mark.parametrize("kind", ["hnsw", "ivf_flat", "ivf_fp16", "ivf_pq"])
def test_approximate_indexes_store_recall(kind, starter_encoder, shared_data, tmp_path):
    spec = IndexSpec(type=kind, nprobe=4)
    result = build_snapshot(shared_data / "coco-mini/captions_val2017.json", starter_encoder, tmp_path,
                            spec=spec, progress=False)
    m = result.manifest
    assert m.index.type == kind and m.recall_queries == 159
    assert 0.0 < m.recall_at_10 <= 1.0
    if kind == "hnsw":
        assert m.recall_at_10 >= 0.95
    snap = Snapshot.load(tmp_path)
    assert len(snap) == 159


@pytest.mark.parametrize("kind", ["flat", "hnsw", "ivf_flat", "ivf_fp16"])
def test_incremental_add_and_remove(kind, starter_encoder, shared_data, tmp_path):
    root = tmp_path / "snap"
    first = build_snapshot(shared_data / "coco-mini/captions_val2017.json", starter_encoder, root,
                           spec=IndexSpec(type=kind), progress=False)
    v1 = first.manifest.version
    def version_files(folder):  # the verified-files record is bookkeeping a load may refresh, not the version
        return {p.name: p.read_bytes() for p in folder.iterdir() if p.name != VERIFIED}

    files_v1 = version_files(first.version_dir)
    added = update_snapshot(root, starter_encoder, add=shared_data / "coco-mini/captions_train2017.json", progress=False)
    assert added.manifest.count == 159 + 80 and added.manifest.parent == v1
    snap = Snapshot.load(root)
    train = json.loads((shared_data / "coco-mini/captions_train2017.json").read_text())
    new_id = train["images"][0]["id"]
    cap = next(a["caption"] for a in train["annotations"] if a["image_id"] == new_id)
    _, ids = snap.search_ids(starter_encoder.encode_text([cap]), 20)
    assert new_id in ids[0]
    assert snap.image_path(new_id).is_file()
    # vectors of the old images are reused, not re-encoded
    old = Snapshot.load(first.version_dir)
    assert np.array_equal(np.asarray(snap.vectors())[:159], np.asarray(old.vectors()))
    removed = update_snapshot(root, starter_encoder, remove=[new_id, 397133], progress=False)
    assert removed.manifest.count == 239 - 2
    snap = Snapshot.load(root)
    assert 397133 not in snap.metadata
    _, ids = snap.search_ids(np.asarray(old.vectors())[:5], 237)
    assert 397133 not in ids and new_id not in ids
    # the old version is untouched
    assert version_files(first.version_dir) == files_v1
    with pytest.raises(SnapshotError, match="not in snapshot"):
        update_snapshot(root, starter_encoder, remove=[123])


def test_tiny_open_clip_bundle_indexes(tiny_clip, shared_data, tmp_path):
    enc = Encoder(tiny_clip[0])
    result = build_snapshot(shared_data / "coco-mini/train2017", enc, tmp_path, progress=False)
    assert result.manifest.count == 80 and result.manifest.dim == 32
    snap = Snapshot.load(tmp_path, image_space=enc.image_space)
    hits = snap.search(enc.encode_text(["a cat"]), 5)[0]
    assert len(hits) == 5 and len({h.id for h in hits}) == 5


@pytest.mark.quick
def test_stale_staging_folders_are_cleaned_but_live_ones_kept(tmp_path):
    import json
    import os
    import subprocess
    import sys

    from paraseek.index.snapshot import OWNER, clean_stale_staging, staging_dir

    root = tmp_path / "snap"
    live = staging_dir(root, "v0003-live")  # owned by this (running) process
    dead_pid = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True).stdout
    dead = staging_dir(root, "v0002-dead")
    owner = json.loads((dead / OWNER).read_text())
    (dead / OWNER).write_text(json.dumps({**owner, "pid": int(dead_pid)}))
    orphan = root / "versions" / ".tmp-v0001-no-owner"
    orphan.mkdir()
    old_foreign = staging_dir(root, "v0004-other-host")
    (old_foreign / OWNER).write_text(json.dumps({"pid": os.getpid(), "host": "another-host"}))
    os.utime(old_foreign, (0, 0))
    removed = clean_stale_staging(root)
    assert sorted(removed) == [".tmp-v0001-no-owner", ".tmp-v0002-dead", ".tmp-v0004-other-host"]
    assert live.is_dir() and not dead.exists() and not orphan.exists()


def test_prune_keeps_newest_current_and_the_one_before(starter_encoder, tmp_path, shared_data):
    from paraseek.index.builder import build_snapshot, update_snapshot
    from paraseek.index.snapshot import activate_version, current_version, prune_versions

    root = tmp_path / "snap"
    build_snapshot(shared_data / "coco-mini/captions_train2017.json", starter_encoder, root, progress=False)
    ids = Snapshot.load(root).ids.tolist()
    for i in range(5):
        update_snapshot(root, starter_encoder, remove=[ids[i]], progress=False)
    versions = sorted(p.name for p in (root / "versions").iterdir())
    assert len(versions) == 6
    activate_version(root, versions[2])  # rolled back to an old one
    removed = prune_versions(root, keep=2)
    kept = sorted(p.name for p in (root / "versions").iterdir())
    # newest two, plus the current version and the one before it
    assert kept == sorted({versions[1], versions[2], versions[4], versions[5]})
    assert sorted(removed) == sorted({versions[0], versions[3]})
    assert current_version(root) == versions[2] and Snapshot.load(root).version == versions[2]
