"""GET /v1/images/{id} serves only files inside the roots a snapshot recorded at build time, and only
what decodes as an image, typed by its content: never a host file that metadata or a planted link
points to."""

import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
from fastapi.testclient import TestClient
from PIL import Image
from typer.testing import CliRunner

from paraseek.core.demo import GALLERY_DIR
from paraseek.index.builder import build_snapshot, build_snapshot_from_vectors, update_snapshot
from paraseek.index.versions import BuildError
from paraseek.index.snapshot import FaissStore, Snapshot
from paraseek.cli import app

BOTH_BACKENDS = True
ON_MILVUS_SERVER = True  # and on a real Milvus 2.3.5 standalone server (the run's shared one)
HOST_FILE = "/etc/passwd"


@pytest.fixture()
def photos(tmp_path) -> Path:
    folder = tmp_path / "photos"
    folder.mkdir()
    for photo in sorted(GALLERY_DIR.glob("*.jpg"))[:4]:
        shutil.copy(photo, folder / photo.name)
    return folder


def vectors_with_paths(encoder, folder: Path, out: Path, paths: list[str]) -> tuple[Path, Path]:
    """v.npy of the folder's photos and m.jsonl whose rows carry ``paths`` as image_path (ids 1..n)."""
    files = sorted(folder.glob("*.jpg"))[:len(paths)]
    np.save(out / "v.npy", encoder.encode_images([Image.open(p).convert("RGB") for p in files]))
    (out / "m.jsonl").write_text("".join(json.dumps({"id": i + 1, "image_path": p, "url": f"https://cdn/{i + 1}.jpg"}) + "\n"
                                         for i, p in enumerate(paths)))
    return out / "v.npy", out / "m.jsonl"


def serve(make_settings, snapshot: Path):
    from paraseek.service.main import create_app

    return TestClient(create_app(make_settings(snapshot=snapshot)))


@pytest.mark.quick
def test_metadata_path_outside_the_roots_is_refused_at_build(starter_encoder, photos, tmp_path):
    inside = sorted(photos.glob("*.jpg"))
    v, m = vectors_with_paths(starter_encoder, photos, tmp_path, [str(inside[0]), inside[1].name, HOST_FILE])
    with pytest.raises(BuildError, match=r"shard v\.npy \(metadata m\.jsonl\) row 2: image path '/etc/passwd' is outside the image roots"):
        build_snapshot_from_vectors(v, tmp_path / "snap", image_space=starter_encoder.image_space, metadata=m,
                                    image_roots=[photos], progress=False)
    v, m = vectors_with_paths(starter_encoder, photos, tmp_path, [inside[0].name, "../photos/../../outside.jpg"])
    with pytest.raises(BuildError, match="row 1: image path '../photos/../../outside.jpg' is outside"):
        build_snapshot_from_vectors(v, tmp_path / "snap", image_space=starter_encoder.image_space, metadata=m,
                                    image_roots=[photos], progress=False)
    store = FaissStore(tmp_path / "snap")
    assert store.current_version() is None and store.versions() == []  # nothing published, nothing left staged


@pytest.mark.quick
def test_cli_names_the_row_and_exits_2(starter_encoder, starter_bundle, photos, tmp_path):
    v, m = vectors_with_paths(starter_encoder, photos, tmp_path, [sorted(photos.glob("*.jpg"))[0].name, HOST_FILE])
    args = ["index", "build", "--embeddings", str(v), "--metadata", str(m), "--bundle", str(starter_bundle),
            "--out", str(tmp_path / "snap"), "--image-root", str(photos)]
    refused = CliRunner().invoke(app, args)
    assert refused.exit_code == 2 and "row 1: image path '/etc/passwd' is outside the image roots" in refused.output
    kept = CliRunner().invoke(app, [*args, "--drop-outside-paths"])
    assert kept.exit_code == 0, kept.output
    snap = Snapshot.load(tmp_path / "snap")
    assert snap.metadata[2] == {"id": 2, "url": "https://cdn/2.jpg"}  # the row stays, without a file to serve
    assert snap.metadata[1]["path"] == sorted(p.name for p in photos.glob("*.jpg"))[0]  # read under the first root
    assert json.loads((snap.path / "report.json").read_text())["paths_outside_roots_dropped"] == 1
    assert snap.manifest.source["image_roots"] == [str(photos.resolve())]


@pytest.mark.quick
def test_only_files_inside_the_roots_that_are_images_are_served(starter_encoder, make_settings, photos, tmp_path):
    files = sorted(photos.glob("*.jpg"))
    # /etc is declared a root on purpose: containment passes, the content check still refuses the file
    v, m = vectors_with_paths(starter_encoder, photos, tmp_path, [files[0].name, str(files[1]), files[2].name, HOST_FILE])
    build_snapshot_from_vectors(v, tmp_path / "snap", image_space=starter_encoder.image_space, metadata=m,
                                image_roots=[photos, "/etc"], progress=False)
    # after the build: one photo becomes a link to a real photo outside the roots, another a text file
    files[2].unlink()
    os.symlink(sorted(GALLERY_DIR.glob("*.jpg"))[20], files[2])
    with serve(make_settings, tmp_path / "snap") as c:
        first = c.get("/v1/images/1")
        assert first.status_code == 200 and first.headers["content-type"] == "image/jpeg"
        assert first.content == files[0].read_bytes()
        assert c.get("/v1/images/2").status_code == 200
        assert c.get("/v1/images/3").status_code == 404  # a link planted later leads outside the roots
        passwd = c.get("/v1/images/4")
        assert passwd.status_code == 404 and "root:" not in passwd.text  # inside a root, but not an image
        files[1].write_text("not an image")
        assert c.get("/v1/images/2").status_code == 404
        # ids past int64 (19 digits pass the pattern): no such image, not a 500
        assert c.get("/v1/images/9999999999999999999").status_code == 404
        assert c.get("/v1/images/99999999999999999999").status_code == 422
        # shown, never run: the browser may not sniff another type, and the image may not script
        assert first.headers["x-content-type-options"] == "nosniff"
        assert first.headers["content-security-policy"] == "default-src 'none'; sandbox"
        files[0].unlink()  # a FIFO planted where a photo was: refused at once, no thread left waiting on it
        os.mkfifo(files[0])
        assert c.get("/v1/images/1").status_code == 404


@pytest.mark.quick
def test_metadata_a_build_did_not_check_never_fails_a_search(starter_encoder, make_settings, photos, tmp_path, monkeypatch):
    from paraseek.index import vector_sources

    files = sorted(photos.glob("*.jpg"))
    v, m = vectors_with_paths(starter_encoder, photos, tmp_path, [f.name for f in files])
    rows = [json.loads(line) for line in m.read_text().splitlines()]
    rows[0].update(license={"name": {"x": 5}, "url": "https://l/1"}, url=["https://cdn/1.jpg"], caption=7)
    rows[1].update(license={"name": 5})
    m.write_text("".join(json.dumps(r) + "\n" for r in rows))
    # a snapshot built before builds typed their metadata: the rows are stored as given
    monkeypatch.setattr(vector_sources, "typed_fields", lambda row, where: row)
    build_snapshot_from_vectors(v, tmp_path / "snap", image_space=starter_encoder.image_space, metadata=m,
                                image_roots=[photos], progress=False)
    with serve(make_settings, tmp_path / "snap") as c:
        r = c.post("/v1/search", json={"query": "a photo", "k": 10})
        assert r.status_code == 200, r.text
        by_id = {hit["id"]: hit for hit in r.json()["results"]}
        assert len(by_id) == len(files)
        assert by_id[1]["licence"] == {"url": "https://l/1"} and "url" not in by_id[1]  # None fields are left out
        assert by_id[1]["captions"] == ["7"] and by_id[2]["licence"]["name"] == "5"
        assert by_id[3]["url"] == "https://cdn/3.jpg"


@pytest.mark.quick
def test_image_builds_and_updates_record_their_roots(starter_encoder, make_settings, photos, tmp_path):
    build_snapshot(photos, starter_encoder, tmp_path / "snap", progress=False)
    more = tmp_path / "more"
    more.mkdir()
    extra = sorted(GALLERY_DIR.glob("*.jpg"))[10]
    shutil.copy(extra, more / extra.name)
    result = update_snapshot(tmp_path / "snap", starter_encoder, add=more, progress=False)
    assert result.manifest.source["image_roots"] == [str(photos.resolve()), str(more.resolve())]
    snap = Snapshot.load(tmp_path / "snap")
    added = next(i for i, row in snap.metadata.items() if row["path"].endswith(extra.name))
    with serve(make_settings, tmp_path / "snap") as c:
        assert c.get(f"/v1/images/{added}").content == extra.read_bytes()
        (photos / "planted.jpg").symlink_to(HOST_FILE)
        assert c.get(f"/v1/images/{added}").status_code == 200
    # a version written before roots were recorded serves from the folder it indexed alone
    manifest = snap.manifest.model_copy(update={"source": {k: v for k, v in snap.manifest.source.items() if k != "image_roots"}})
    legacy = Snapshot.__new__(Snapshot)
    legacy.__dict__.update(snap.__dict__, manifest=manifest)
    assert legacy.image_roots == [Path(str(photos.resolve()))]
    assert legacy.image_path(added) is None
