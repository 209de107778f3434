"""A rebuild encodes only new and changed photos; unchanged ones keep the current version's vectors."""

import copy
import io
import os
import shutil
import tarfile
import time

import numpy as np
import pytest

from paraseek.core.encoder import Encoder
from paraseek.index.builder import build_snapshot, plan_build, update_snapshot
from paraseek.index.faiss_index import IndexSpec
from paraseek.index.image_sources import ImageRecord
from paraseek.index.snapshot import FaissStore
from paraseek.index.unchanged_images import (
    DIGEST_FIELD,
    INPUTS_FIELD,
    STAMP_FIELD,
    TOWER_FIELD,
    KnownVectors,
    content_digest,
    file_digest,
    file_stamp,
    inputs_digest,
    record_digest,
)

BOTH_BACKENDS = True


@pytest.mark.quick
def test_file_stamp_changes_with_a_rewrite_and_is_none_for_a_missing_file(tmp_path):
    f = tmp_path / "a.jpg"
    f.write_bytes(b"abc")
    first = file_stamp(f)
    assert first is not None and first[0] == 3
    assert file_stamp(f) == first  # reading a file leaves it unchanged
    os.utime(f, ns=(first[1] + 10**9, first[1] + 10**9))  # same bytes, rewritten later (e.g. restored from a backup)
    assert file_stamp(f) != first
    assert file_stamp(tmp_path / "missing.jpg") is None


@pytest.mark.quick
def test_file_digest_is_the_digest_of_the_bytes_read(tmp_path):
    f = tmp_path / "a.jpg"
    f.write_bytes(b"abc")
    assert file_digest(f) == content_digest(b"abc") and len(file_digest(f) or "") == 32
    f.write_bytes(b"abd")
    assert file_digest(f) != content_digest(b"abc")
    assert file_digest(tmp_path / "missing.jpg") is None and file_digest(tmp_path) is None  # a folder cannot be read


@pytest.mark.quick
def test_source_digests_stopped_midway_hash_no_further_chunks(tmp_path, monkeypatch):
    from paraseek.index import unchanged_images
    from paraseek.index.image_sources import open_source

    for i in range(40):
        (tmp_path / f"{i:03d}.jpg").write_bytes(bytes([i]))
    src = open_source(tmp_path)
    assert unchanged_images.source_digests(src, workers=1, chunk=1) == [content_digest(bytes([i])) for i in range(40)]
    hashed = []
    real = unchanged_images.record_digest

    def slow(root, record):  # a file read from a slow disk: the stop comes long before the rest are hashed
        hashed.append(record.path)
        if len(hashed) > 1:
            time.sleep(0.05)
        return real(root, record)

    monkeypatch.setattr(unchanged_images, "record_digest", slow)

    class Stop(Exception):
        pass

    def stop(done, total):
        raise Stop  # a cancelled job's progress report

    with pytest.raises(Stop):
        unchanged_images.source_digests(src, workers=1, chunk=1, on_progress=stop)
    time.sleep(0.2)  # a worker still hashing would go on meanwhile
    assert 1 <= len(hashed) <= 20  # the first chunk and the few begun while it stopped, not all 40 first


@pytest.mark.quick
def test_inputs_digest_changes_with_anything_a_build_reads():
    records = [ImageRecord(1, "a.jpg", captions=["a dog"]), ImageRecord(2, "b.jpg", license={"name": "cc-by"})]
    stamps = [[10, 1_000], [20, 2_000]]
    settings = {"index": {"type": "auto"}, "image_tower": "t1"}
    base = inputs_digest(records, stamps, [], settings)
    assert inputs_digest(copy.deepcopy(records), [list(s) for s in stamps], [], dict(settings)) == base
    recaptioned = copy.deepcopy(records)
    recaptioned[0].captions = ["a cat"]
    renamed = copy.deepcopy(records)
    renamed[1].path = "c.jpg"
    changed = [
        inputs_digest(recaptioned, stamps, [], settings),
        inputs_digest(renamed, stamps, [], settings),
        inputs_digest(records, [[10, 1_000], [20, 2_001]], [], settings),  # b.jpg rewritten
        inputs_digest(records, [[10, 1_000], None], [], settings),  # b.jpg unreadable now
        inputs_digest(records[:1], stamps[:1], [], settings),
        inputs_digest(records[::-1], stamps[::-1], [], settings),  # another order: other positions
        inputs_digest(records, stamps, [{"path": "x.jpg", "error": "a link out of the root"}], settings),
        inputs_digest(records, stamps, [], {**settings, "index": {"type": "flat"}}),
        inputs_digest(records, stamps, [], {**settings, "image_tower": "t2"}),
    ]
    assert base not in changed and len(set(changed)) == len(changed)
    with pytest.raises(ValueError):
        inputs_digest(records, stamps[:1], [], settings)  # a stamp for every record


@pytest.fixture()
def photos(shared_data, tmp_path):
    folder = tmp_path / "photos"
    folder.mkdir()
    for p in sorted((shared_data / "coco-mini/val2017").glob("*.jpg"))[:6]:
        shutil.copy(p, folder / p.name)
    return folder


@pytest.fixture()
def counted_encodes(monkeypatch) -> list[int]:
    """Photos encoded, per call of the image tower."""
    calls: list[int] = []
    real = Encoder.encode_pixels

    def counting(self, pixels):
        calls.append(len(pixels))
        return real(self, pixels)

    monkeypatch.setattr(Encoder, "encode_pixels", counting)
    return calls


def store_for(backend, tmp_path, request):
    return FaissStore(tmp_path / "snap") if backend == "faiss" else request.getfixturevalue("milvus_store")


def vectors_by_id(store) -> dict[int, np.ndarray]:
    snap = store.load(use_gpu=False)
    try:
        ids, vectors, _ = snap.contents()
        return {int(i): np.asarray(v) for i, v in zip(ids, vectors)}
    finally:
        snap.close()


@pytest.mark.quick
def test_a_rebuild_encodes_only_new_and_changed_photos(backend, photos, starter_encoder, counted_encodes, shared_data,
                                                       tmp_path, request):
    store = store_for(backend, tmp_path, request)
    first = build_snapshot(photos, starter_encoder, store, progress=False)
    assert sum(counted_encodes) == 6 and first.report["reused"] == 0 and first.report["encoded"] == 6
    assert first.manifest.source[TOWER_FIELD] == starter_encoder.image_tower_id
    before = vectors_by_id(store)

    counted_encodes.clear()
    again = build_snapshot(photos, starter_encoder, store, progress=False, spec=IndexSpec(type="flat"))  # another index
    assert counted_encodes == [] and again.report["reused"] == 6 and again.report["reused_from"] == first.manifest.version
    assert again.report["encoded"] == 0 and again.manifest.version != first.manifest.version
    assert again.manifest.count == 6 and again.manifest.parent is None
    assert {i: v.tobytes() for i, v in vectors_by_id(store).items()} == {i: v.tobytes() for i, v in before.items()}

    names = sorted(p.name for p in photos.iterdir())
    others = sorted((shared_data / "coco-mini/val2017").glob("*.jpg"))[6:8]
    shutil.copy(others[0], photos / names[0])  # a photo replaced under the same name
    (photos / names[1]).unlink()  # one removed
    shutil.copy(others[1], photos / "new.jpg")  # one added
    counted_encodes.clear()
    progress: list[tuple[str, int, int]] = []
    third = build_snapshot(photos, starter_encoder, store, progress=False,
                           on_progress=lambda *step: progress.append(step))
    assert sum(counted_encodes) == 2 and third.report["reused"] == 4 and third.report["encoded"] == 2
    # the reused photos count as done when encoding starts; the version is indexed and written last (the
    # store reports every row indexed again before measuring recall and before publishing: where a cancel lands)
    steps = [step for i, step in enumerate(progress) if i == 0 or step != progress[i - 1]]
    assert steps == [("reusing", 0, 6), ("encoding", 4, 6), ("encoding", 5, 6), ("encoding", 6, 6),
                     ("indexing", 0, 6), ("indexing", 6, 6)]
    assert progress.count(("indexing", 6, 6)) >= 3
    after = vectors_by_id(store)
    assert len(after) == 6
    # every vector is what encoding the folder from scratch gives: the reused ones and the new ones
    fresh = build_snapshot(photos, starter_encoder, FaissStore(tmp_path / "fresh"), progress=False, reuse=False)
    expected = vectors_by_id(FaissStore(tmp_path / "fresh"))
    assert fresh.report["reused"] == 0 and set(after) == set(expected)
    for image_id, vector in expected.items():
        np.testing.assert_allclose(after[image_id], vector, atol=1e-5)
    # metadata rows carry the stamp the next build compares, and the photo's size
    snap = store.load(use_gpu=False)
    try:
        rows = snap.metadata_of(list(after))
        assert all(row[STAMP_FIELD] == file_stamp(photos / row["path"]) and row["width"] > 0 for row in rows.values())
    finally:
        snap.close()


@pytest.mark.quick
def test_moved_renamed_and_copied_photos_are_found_by_their_bytes(backend, photos, starter_encoder, counted_encodes,
                                                                  tmp_path, request):
    store = store_for(backend, tmp_path, request)
    first = build_snapshot(photos, starter_encoder, store, progress=False)
    before = vectors_by_path(store)
    a, b, c, d = sorted(p.name for p in photos.iterdir())[:4]
    (photos / "sub").mkdir()
    os.rename(photos / a, photos / "sub" / a)  # moved into a folder
    os.rename(photos / b, photos / f"renamed-{b}")
    shutil.copy(photos / c, photos / f"copy-of-{c}")  # a second copy (a new modification time)
    altered = bytearray((photos / d).read_bytes())
    altered[len(altered) // 2] ^= 1  # same size, other bytes: still decodes, to another vector
    (photos / f"altered-{d}").write_bytes(bytes(altered))
    counted_encodes.clear()
    plan = plan_build(photos, starter_encoder, store)
    assert (plan["reuse"], plan["moved"], plan["encode"]) == (7, 3, 1) and counted_encodes == []  # what the build does
    again = build_snapshot(photos, starter_encoder, store, progress=False)
    assert sum(counted_encodes) == 1  # the altered copy only
    assert again.report["reused"] == 7 and again.report["moved"] == 3 and again.report["encoded"] == 1
    assert again.report["reused_from"] == first.manifest.version
    vectors, rows = contents_by_row(store)
    after = {row["path"]: vector for row, vector in zip(rows, vectors)}
    for now, then in ((f"sub/{a}", a), (f"renamed-{b}", b), (f"copy-of-{c}", c), (c, c), (d, d)):
        assert after[now].tobytes() == before[then].tobytes(), now
    assert after[f"altered-{d}"].tobytes() != before[d].tobytes()
    # every row records the digest and stamp of the file it now names, for the next build
    assert all(row[DIGEST_FIELD] == file_digest(photos / row["path"]) and row[STAMP_FIELD] == file_stamp(photos / row["path"])
               for row in rows)


@pytest.mark.quick
def test_a_rebuild_with_nothing_changed_keeps_the_current_version(backend, photos, starter_encoder, counted_encodes,
                                                                  shared_data, tmp_path, request):
    store = store_for(backend, tmp_path, request)
    first = build_snapshot(photos, starter_encoder, store, progress=False)
    assert len(first.manifest.source[INPUTS_FIELD]) == 32
    counted_encodes.clear()
    assert plan_build(photos, starter_encoder, store) == {"images_total": 6, "refused": 0, "current": first.manifest.version,
                                                          "unchanged": True, "reuse": 6, "moved": 0, "encode": 0,
                                                          "undecodable": 0}
    same = build_snapshot(photos, starter_encoder, store, progress=False)
    assert same.report["unchanged"] and same.report["images_total"] == 6 and same.report["encoded"] == 0
    assert same.manifest == first.manifest and same.location == first.location and counted_encodes == []
    assert store.versions() == [first.manifest.version] and store.current_version() == first.manifest.version
    if backend == "faiss":
        assert not list((tmp_path / "snap" / "versions").glob(".tmp-*"))  # no version begun

    # a version derived from the build (an update) is not what building those inputs writes: built again
    extra = tmp_path / "extra"
    extra.mkdir()
    shutil.copy(sorted((shared_data / "coco-mini/val2017").glob("*.jpg"))[10], extra / "x.jpg")
    updated = update_snapshot(store, starter_encoder, add=extra, progress=False)
    assert INPUTS_FIELD not in updated.manifest.source
    plan = plan_build(photos, starter_encoder, store)
    assert not plan["unchanged"] and (plan["reuse"], plan["encode"], plan["current"]) == (6, 0, updated.manifest.version)
    assert store.versions() == [first.manifest.version, updated.manifest.version]  # a plan writes nothing
    rebuilt = build_snapshot(photos, starter_encoder, store, progress=False)
    assert "unchanged" not in rebuilt.report and rebuilt.report["reused"] == 6 and rebuilt.manifest.count == 6
    assert store.current_version() == rebuilt.manifest.version
    # a touched photo (same bytes) is a change of inputs: a new version, its vector found by its digest
    stamp = file_stamp(next(photos.iterdir()))
    assert stamp is not None
    os.utime(next(photos.iterdir()), ns=(stamp[1] + 10**9, stamp[1] + 10**9))
    counted_encodes.clear()
    touched = build_snapshot(photos, starter_encoder, store, progress=False)
    assert "unchanged" not in touched.report and touched.manifest.version != rebuilt.manifest.version
    assert touched.report["reused"] == 6 and counted_encodes == []


def vectors_by_path(store) -> dict[str, np.ndarray]:
    vectors, rows = contents_by_row(store)
    return {row["path"]: vector for row, vector in zip(rows, vectors)}


def contents_by_row(store) -> tuple[list[np.ndarray], list[dict]]:
    snap = store.load(use_gpu=False)
    try:
        ids, vectors, _ = snap.contents()
        rows = snap.metadata_of(ids)
        return [np.asarray(v) for v in vectors], [rows[int(i)] for i in ids]
    finally:
        snap.close()


@pytest.mark.quick
def test_no_reuse_across_image_towers_or_when_asked_not_to(photos, starter_encoder, counted_encodes, tmp_path):
    root = tmp_path / "snap"
    build_snapshot(photos, starter_encoder, root, progress=False)
    counted_encodes.clear()
    assert build_snapshot(photos, starter_encoder, root, progress=False, reuse=False).report["reused"] == 0
    assert sum(counted_encodes) == 6

    retrained = copy.copy(starter_encoder)
    retrained.image_tower_id = "another-image-tower"  # what another bundle's tower (weights, preprocessing) gives
    counted_encodes.clear()
    other = build_snapshot(photos, retrained, root, progress=False)
    assert other.report["reused"] == 0 and sum(counted_encodes) == 6
    assert other.manifest.source[TOWER_FIELD] == "another-image-tower"

    unknown = starter_encoder.with_image_model(starter_encoder.path / starter_encoder.manifest.image.file)
    assert unknown.image_tower_id is None  # a graph the manifest does not describe: never trusted
    counted_encodes.clear()
    assert build_snapshot(photos, unknown, root, progress=False).report["reused"] == 0 and sum(counted_encodes) == 6


@pytest.mark.quick
def test_known_vectors_are_taken_for_the_photos_whose_bytes_they_name(photos, starter_encoder, counted_encodes, tmp_path):
    """Vectors kept apart from any version (the demo gallery's ship with the package): a build with no current
    version takes them for the photos with those bytes, made by that tower, and encodes the rest."""
    build_snapshot(photos, starter_encoder, tmp_path / "made", progress=False)
    made = vectors_by_id(FaissStore(tmp_path / "made"))
    rows = FaissStore(tmp_path / "made").load(use_gpu=False).metadata_of(list(made))
    names = sorted(p.name for p in photos.iterdir())
    known_ids = [i for i in made if rows[i]["path"] in names[:4]]  # four of the six photos
    known = KnownVectors("earlier vectors", starter_encoder.image_tower_id,
                         np.array([rows[i][DIGEST_FIELD] for i in known_ids]), np.stack([made[i] for i in known_ids]),
                         np.array([rows[i]["width"] for i in known_ids]), np.array([rows[i]["height"] for i in known_ids]))
    known.save(tmp_path / "known.npz")
    known = KnownVectors.load(tmp_path / "known.npz", "earlier vectors")
    counted_encodes.clear()
    built = build_snapshot(photos, starter_encoder, tmp_path / "snap", progress=False, known=known)
    assert sum(counted_encodes) == 2 and built.report["reused"] == 4 and built.report["encoded"] == 2
    assert built.report["reused_from"] == "earlier vectors"
    got = vectors_by_id(FaissStore(tmp_path / "snap"))
    assert sorted(got) == sorted(made) and all(np.array_equal(got[i], made[i]) for i in known_ids)
    assert FaissStore(tmp_path / "snap").load(use_gpu=False).metadata_of(known_ids) == {i: rows[i] for i in known_ids}
    # another tower's: every photo encoded
    other = KnownVectors("earlier vectors", "another-image-tower", known.digests, known.vectors, known.widths, known.heights)
    counted_encodes.clear()
    assert build_snapshot(photos, starter_encoder, tmp_path / "other", progress=False, known=other).report["reused"] == 0
    assert sum(counted_encodes) == 6


@pytest.mark.quick
def test_an_update_with_another_tower_leaves_nothing_to_reuse(photos, starter_encoder, shared_data, counted_encodes,
                                                              tmp_path):
    root = tmp_path / "snap"
    build_snapshot(photos, starter_encoder, root, progress=False)
    extra = tmp_path / "extra"
    extra.mkdir()
    shutil.copy(sorted((shared_data / "coco-mini/val2017").glob("*.jpg"))[10], extra / "x.jpg")
    retrained = copy.copy(starter_encoder)
    retrained.image_tower_id = "another-image-tower"
    mixed = update_snapshot(root, retrained, add=extra, progress=False)
    assert mixed.manifest.source[TOWER_FIELD] is None  # two towers' vectors in one version
    counted_encodes.clear()
    assert build_snapshot(photos, starter_encoder, root, progress=False).report["reused"] == 0
    assert sum(counted_encodes) == 6


@pytest.mark.quick
def test_photos_in_tar_shards_are_reused_and_found_by_their_bytes_when_their_shard_changes(photos, starter_encoder,
                                                                                           counted_encodes, tmp_path):
    shards = tmp_path / "shards"
    shards.mkdir()

    def write_shard(name, files, first_key):
        with tarfile.open(shards / name, "w") as tar:
            for i, p in enumerate(files):
                data = p.read_bytes()
                info = tarfile.TarInfo(f"{first_key + i:05d}.jpg")  # numeric keys are the images' ids
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))

    files = sorted(photos.iterdir())
    write_shard("a.tar", files[:3], 0)
    write_shard("b.tar", files[3:], 3)
    root = tmp_path / "snap"
    assert build_snapshot(shards, starter_encoder, root, progress=False).manifest.count == 6
    counted_encodes.clear()
    before = vectors_by_id(FaissStore(root))
    write_shard("b.tar", files[3:][::-1], 3)  # shard b rewritten: its photos under other members
    os.utime(shards / "b.tar", ns=(1, 1))  # whatever its time, its stamp differs from the one recorded
    again = build_snapshot(shards, starter_encoder, root, progress=False)
    assert (again.report["reused"], again.report["moved"], again.report["encoded"]) == (6, 3, 0) and counted_encodes == []
    after = vectors_by_id(FaissStore(root))
    assert [after[i].tobytes() for i in (3, 4, 5)] == [before[i].tobytes() for i in (5, 4, 3)]  # each photo's own
    altered = bytearray(files[0].read_bytes())
    altered[len(altered) // 2] ^= 1
    (tmp_path / "altered.jpg").write_bytes(bytes(altered))
    write_shard("a.tar", [tmp_path / "altered.jpg", *files[1:3]], 0)  # one member's bytes changed
    last = build_snapshot(shards, starter_encoder, root, progress=False)
    assert (last.report["reused"], last.report["encoded"]) == (5, 1) and sum(counted_encodes) == 1


@pytest.mark.quick
def test_a_current_version_that_fails_its_checksums_is_not_reused_and_the_build_goes_on(photos, starter_encoder,
                                                                                        counted_encodes, tmp_path, caplog):
    root = tmp_path / "snap"
    first = build_snapshot(photos, starter_encoder, root, progress=False)
    vectors = first.version_dir / "vectors.npy"
    data = bytearray(vectors.read_bytes())
    data[-1] ^= 0xFF  # one vector altered on disk
    vectors.write_bytes(bytes(data))
    counted_encodes.clear()
    rebuilt = build_snapshot(photos, starter_encoder, root, progress=False)
    assert rebuilt.report["reused"] == 0 and sum(counted_encodes) == 6  # encoded from the files instead
    assert "not reusing vectors of the current version" in caplog.text and "vectors.npy" in caplog.text
    # the same inputs, but a version that no longer reads back whole is not kept
    assert "not keeping the current version as it is" in caplog.text
    assert rebuilt.manifest.version != first.manifest.version


def write_tar_shard(path, named_bytes: dict[str, bytes]) -> None:
    with tarfile.open(path, "w") as tar:
        for name, data in named_bytes.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))


@pytest.mark.quick
def test_record_digest_is_the_digest_of_a_file_or_of_its_tar_member(tmp_path):
    (tmp_path / "a.jpg").write_bytes(b"file bytes")
    write_tar_shard(tmp_path / "s.tar", {"00001.jpg": b"member one", "00002.jpg": b"member two"})
    with tarfile.open(tmp_path / "s.tar") as tar:
        members = {m.name: m for m in tar.getmembers()}
    record = lambda name: ImageRecord(id=int(name[:5]), path="s.tar", member=name,  # noqa: E731
                                      offset=members[name].offset_data, size=members[name].size)
    assert record_digest(tmp_path, ImageRecord(id=0, path="a.jpg")) == content_digest(b"file bytes")
    assert record_digest(tmp_path, record("00002.jpg")) == content_digest(b"member two")
    assert record_digest(tmp_path, ImageRecord(id=0, path="gone.jpg")) is None
    (tmp_path / "s.tar").write_bytes(b"short")  # the member's bytes are no longer there
    assert record_digest(tmp_path, record("00002.jpg")) is None


def same_size_other_photo(path) -> None:
    """Another photo in the file's place with the file's size and modification time: what a stamp cannot see
    (a restore that kept the original's time, a clock set back)."""
    size, mtime = file_stamp(path) or (0, 0)
    altered = bytearray(path.read_bytes())
    altered[len(altered) // 2] ^= 1  # still decodes, to another vector
    path.write_bytes(bytes(altered))
    os.utime(path, ns=(mtime, mtime))
    assert file_stamp(path) == [size, mtime]


@pytest.mark.quick
def test_a_checksum_build_finds_a_photo_replaced_under_the_same_stamp(backend, photos, starter_encoder, counted_encodes,
                                                                      tmp_path, request):
    store = store_for(backend, tmp_path, request)
    first = build_snapshot(photos, starter_encoder, store, progress=False)
    before = vectors_by_path(store)
    replaced = sorted(photos.iterdir())[2]
    same_size_other_photo(replaced)
    counted_encodes.clear()
    assert plan_build(photos, starter_encoder, store)["unchanged"]  # by stamps, nothing changed
    plan = plan_build(photos, starter_encoder, store, checksum=True)
    assert not plan["unchanged"] and (plan["reuse"], plan["moved"], plan["encode"]) == (5, 0, 1) and counted_encodes == []
    phases: list[str] = []
    rebuilt = build_snapshot(photos, starter_encoder, store, progress=False, checksum=True,
                             on_progress=lambda phase, done, total: phases.append(phase))
    assert sum(counted_encodes) == 1 and rebuilt.report["reused"] == 5 and rebuilt.report["encoded"] == 1
    assert list(dict.fromkeys(phases)) == ["hashing", "reusing", "encoding", "indexing"]  # every photo hashed first
    assert rebuilt.report["reused_from"] == first.manifest.version
    after = vectors_by_path(store)
    assert after[replaced.name].tobytes() != before[replaced.name].tobytes()
    assert all(after[name].tobytes() == before[name].tobytes() for name in before if name != replaced.name)
    fresh = build_snapshot(photos, starter_encoder, FaissStore(tmp_path / "fresh"), progress=False, reuse=False)
    expected = {int(i): v for i, v in vectors_by_id(FaissStore(tmp_path / "fresh")).items()}
    assert fresh.manifest.count == 6
    for image_id, vector in vectors_by_id(store).items():  # what encoding the folder from scratch gives
        np.testing.assert_allclose(vector, expected[image_id], atol=1e-5)

    counted_encodes.clear()  # nothing changed since, by bytes too: the version stays
    same = build_snapshot(photos, starter_encoder, store, progress=False, checksum=True)
    assert same.report["unchanged"] and same.manifest.version == rebuilt.manifest.version and counted_encodes == []
    # a touched photo is a change of stamps (a new version), but a checksum build finds it where it was
    stamp = file_stamp(replaced)
    assert stamp is not None
    os.utime(replaced, ns=(stamp[1] + 10**9, stamp[1] + 10**9))
    touched = build_snapshot(photos, starter_encoder, store, progress=False, checksum=True)
    assert (touched.report["reused"], touched.report["moved"], touched.report["encoded"]) == (6, 0, 0)
    assert counted_encodes == [] and touched.manifest.version != rebuilt.manifest.version


@pytest.mark.quick
def test_a_checksum_build_finds_a_photo_that_could_not_be_decoded_replaced_under_its_stamp(
        backend, photos, starter_encoder, counted_encodes, tmp_path, request, shared_data):
    """A file the version skipped (it did not decode) holds no row to compare, so its bytes are recorded in
    the manifest: repaired in place with the same size and time, a checksum build encodes it."""
    store = store_for(backend, tmp_path, request)
    broken = photos / "broken.jpg"
    good = sorted((shared_data / "coco-mini/val2017").glob("*.jpg"))[6].read_bytes()  # not among the photos
    broken.write_bytes(b"\0" * len(good))  # a photo's size, none of its bytes
    first = build_snapshot(photos, starter_encoder, store, progress=False)
    assert first.manifest.count == 6 and [s["path"] for s in first.report["skipped"]] == ["broken.jpg"]
    counted_encodes.clear()
    same = build_snapshot(photos, starter_encoder, store, progress=False, checksum=True)
    assert same.report["unchanged"] and counted_encodes == []  # the skipped file kept its bytes too
    assert plan_build(photos, starter_encoder, store, checksum=True)["undecodable"] == 1
    for kept in (same, build_snapshot(photos, starter_encoder, store, progress=False)):  # by bytes, by stamps
        assert [s["path"] for s in kept.report["skipped"]] == ["broken.jpg"] and kept.skipped == kept.report["skipped"]
        assert first.manifest.version in kept.skipped[0]["error"]  # the file is still there, and still not indexed

    stamp = file_stamp(broken)
    assert stamp is not None
    broken.write_bytes(good)  # repaired, a restore keeping the damaged file's time
    os.utime(broken, ns=(stamp[1], stamp[1]))
    assert file_stamp(broken) == stamp
    assert plan_build(photos, starter_encoder, store)["unchanged"]  # by stamps, nothing changed
    plan = plan_build(photos, starter_encoder, store, checksum=True)
    assert not plan["unchanged"] and plan["encode"] == 1
    repaired = build_snapshot(photos, starter_encoder, store, progress=False, checksum=True)
    assert repaired.manifest.count == 7 and repaired.report["skipped"] == []
    assert (repaired.report["reused"], repaired.report["encoded"]) == (6, 1) and sum(counted_encodes) == 1


@pytest.mark.quick
def test_a_checksum_build_compares_tar_members_by_their_bytes(photos, starter_encoder, counted_encodes, tmp_path):
    shards = tmp_path / "shards"
    shards.mkdir()
    files = sorted(photos.iterdir())
    contents = {f"{i:05d}.jpg": p.read_bytes() for i, p in enumerate(files)}  # numeric keys are the images' ids
    write_tar_shard(shards / "a.tar", contents)
    root = tmp_path / "snap"
    build_snapshot(shards, starter_encoder, root, progress=False)
    rows = contents_by_row(FaissStore(root))[1]
    assert all(row[DIGEST_FIELD] == content_digest(contents[row["member"]]) for row in rows)  # members record theirs
    stamp = file_stamp(shards / "a.tar")
    assert stamp is not None
    altered = bytearray(contents["00004.jpg"])
    altered[len(altered) // 2] ^= 1
    write_tar_shard(shards / "a.tar", {**contents, "00004.jpg": bytes(altered)})  # one member's bytes, same size
    os.utime(shards / "a.tar", ns=(stamp[1], stamp[1]))
    assert file_stamp(shards / "a.tar") == stamp
    counted_encodes.clear()
    assert build_snapshot(shards, starter_encoder, root, progress=False).report["unchanged"]  # stamps see nothing
    again = build_snapshot(shards, starter_encoder, root, progress=False, checksum=True)
    assert (again.report["reused"], again.report["encoded"]) == (5, 1) and sum(counted_encodes) == 1
