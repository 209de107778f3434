"""Webdataset tar shards as an image source: indexed in place, searched, and served by the API."""

import io
import json
import tarfile

import pytest
from fastapi.testclient import TestClient

from paraseek.core.demo import GALLERY_DIR
from paraseek.index.builder import build_snapshot
from paraseek.index.image_sources import ImageSourceError, expand_braces, open_source
from paraseek.index.snapshot import Snapshot

pytestmark = pytest.mark.quick


def add(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    tar.addfile(info, io.BytesIO(data))


def write_shards(folder, photos, per_shard=3):
    """{00000..0000N}.tar: KEY.jpg with KEY.txt (first shard) or KEY.json (others), one broken image."""
    folder.mkdir(parents=True, exist_ok=True)
    names = []
    for shard, start in enumerate(range(0, len(photos), per_shard)):
        name = folder / f"{shard:05d}.tar"
        with tarfile.open(name, "w") as tar:
            for i, photo in enumerate(photos[start:start + per_shard]):
                key = f"{shard:05d}{i:04d}"
                add(tar, f"{key}.jpg", photo.read_bytes())
                if shard == 0:
                    add(tar, f"{key}.txt", f"caption of {key}".encode())
                else:
                    add(tar, f"{key}.json", json.dumps({"caption": f"caption of {key}", "url": f"http://x/{key}.jpg",
                                                        "license": "CC BY 2.0"}).encode())
            if shard == 1:
                add(tar, "broken.jpg", b"not a jpeg at all")
        names.append(name)
    return names


def test_brace_patterns_expand_like_webdataset():
    assert expand_braces("s/{00000..00002}.tar") == ["s/00000.tar", "s/00001.tar", "s/00002.tar"]
    assert expand_braces("{a,b}-{1..2}.tar") == ["a-1.tar", "a-2.tar", "b-1.tar", "b-2.tar"]
    # counted before any name is made: a pattern naming a billion shards is refused at once
    with pytest.raises(ImageSourceError, match=r"names more than 100000 shards"):
        expand_braces("s/{0..999999999}.tar")
    with pytest.raises(ImageSourceError, match=r"names more than 100000 shards"):
        expand_braces("s/{0..999}-{0..999}.tar")


def test_hostile_webdataset_metadata_is_reported_and_the_image_indexed_without_it(tmp_path):
    import io
    import json
    import tarfile

    photo = sorted(GALLERY_DIR.glob("*.jpg"))[0].read_bytes()
    (tmp_path / "wds").mkdir()
    with tarfile.open(tmp_path / "wds" / "00000.tar", "w") as tar:
        for key, info in (("1", {"caption": "a bus", "license": {"name": {"nested": 1}}, "url": "https://x/1"}),
                          ("2", {"caption": 7, "license": "CC BY 2.0", "url": 12}),
                          ("3", {"caption": "x" * (2 << 20)})):  # a 2 MB member: left out unread
            for name, data in ((f"{key}.jpg", photo), (f"{key}.json", json.dumps(info).encode())):
                member = tarfile.TarInfo(name)
                member.size = len(data)
                tar.addfile(member, io.BytesIO(data))
    source = open_source(f"{tmp_path / 'wds'}/{{00000..00000}}.tar")
    first, second, third = sorted(source.records, key=lambda r: r.id)
    assert (first.captions, first.license, first.url) == ([], None, None)
    assert third.captions == []
    assert source.rejected == [
        {"path": "00000.tar:3.json", "error": f"{(2 << 20) + 15} bytes, more than a caption or metadata member may have "
                                              f"({1 << 20}); left out"},
        {"path": "00000.tar:1.json", "error": "00000.tar:1.json: license.name: text expected, got dict {'nested': 1}; "
                                              "the image is indexed without its metadata"}]
    assert (second.captions, second.license, second.url) == (["7"], {"name": "CC BY 2.0"}, "12")


def test_tar_shards_are_indexed_in_place_and_served(starter_encoder, make_settings, tmp_path):
    photos = sorted(GALLERY_DIR.glob("*.jpg"))[:7]
    write_shards(tmp_path / "wds", photos)
    source = open_source(f"{tmp_path / 'wds'}/{{00000..00002}}.tar")
    assert source.kind == "webdataset" and len(source.records) == 8  # 7 photos + the broken member
    assert not list((tmp_path / "wds").glob("*.jpg"))  # nothing unpacked
    result = build_snapshot(f"{tmp_path / 'wds'}/{{00000..00002}}.tar", starter_encoder, tmp_path / "snap", progress=False)
    assert result.manifest.count == 7
    assert [s["path"] for s in result.skipped] == ["00001.tar:broken.jpg"]  # reported and skipped
    snap = Snapshot.load(tmp_path / "snap")
    meta = snap.metadata[10001]  # key "000010001": photo 2 of shard 1
    assert meta["captions"] == ["caption of 000010001"] and meta["url"] == "http://x/000010001.jpg"
    assert meta["license"] == {"name": "CC BY 2.0"} and meta["path"] == "00001.tar"
    assert snap.metadata[1]["captions"] == ["caption of 000000001"]  # from the .txt member
    # the same photo found by its own image vector, from the shard, ranks first
    query = starter_encoder.encode_images([__import__("PIL.Image", fromlist=["Image"]).open(photos[4]).convert("RGB")])
    assert snap.search(query, 1)[0][0].id == 10001
    with TestClient(__import__("paraseek.service.main", fromlist=["create_app"]).create_app(make_settings(snapshot=tmp_path / "snap"))) as c:
        image = c.get("/v1/images/10001")
        assert image.status_code == 200 and image.headers["content-type"] == "image/jpeg"
        assert image.content == photos[4].read_bytes()  # the member's bytes, not the tar


def test_folder_of_shards_and_a_single_shard(starter_encoder, tmp_path):
    photos = sorted(GALLERY_DIR.glob("*.jpg"))[:4]
    shards = write_shards(tmp_path / "wds", photos, per_shard=2)
    assert open_source(tmp_path / "wds").kind == "webdataset"
    assert len(open_source(shards[0]).records) == 2


def test_snapshot_of_precomputed_vectors_is_served(starter_encoder, starter_bundle, make_settings, tmp_path):
    """Vectors made elsewhere in the bundle's image space, with a url but no file path: searched and
    answered (path absent, url from the metadata), and `index search` prints them too."""
    import numpy as np
    from PIL import Image
    from typer.testing import CliRunner

    from paraseek.cli import app
    from paraseek.index.builder import build_snapshot_from_vectors

    photos = sorted(GALLERY_DIR.glob("*.jpg"))[:5]
    vectors = starter_encoder.encode_images([Image.open(p).convert("RGB") for p in photos])
    np.save(tmp_path / "v.npy", vectors)
    (tmp_path / "v.jsonl").write_text("".join(json.dumps({"id": 7 + i, "url": f"https://cdn/{i}.jpg", "caption": f"c{i}"}) + "\n"
                                              for i in range(5)))
    build_snapshot_from_vectors(tmp_path / "v.npy", tmp_path / "snap", image_space=starter_encoder.image_space, progress=False)
    create_app = __import__("paraseek.service.main", fromlist=["create_app"]).create_app
    with TestClient(create_app(make_settings(snapshot=tmp_path / "snap"))) as c:
        r = c.post("/v1/search", json={"query": "a photo", "k": 5, "expansion": {"method": "none"}})
        assert r.status_code == 200, r.text
        results = r.json()["results"]
        assert {x["id"] for x in results} == {7, 8, 9, 10, 11}
        assert all(x.get("path") is None and x["url"] == f"https://cdn/{x['id'] - 7}.jpg" for x in results)
        assert c.get("/v1/images/7").status_code == 404  # nothing on disk to serve
    out = CliRunner().invoke(app, ["index", "search", "a photo", "--snapshot", str(tmp_path / "snap"),
                                    "--bundle", str(starter_bundle), "--json"])
    assert out.exit_code == 0, out.output
    assert json.loads(out.output)[0]["results"][0]["path"] is None
