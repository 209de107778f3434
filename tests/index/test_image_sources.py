"""What an image source lets into an index: files whose real location is inside its folder."""

import json

import pytest

from paraseek.index.image_sources import OUTSIDE, open_source


pytestmark = pytest.mark.quick


@pytest.fixture()
def tree(tmp_path):
    """photos/ with a plain file, links to files and folders inside and outside it; secret/ beside it."""
    photos, secret = tmp_path / "photos", tmp_path / "secret"
    (photos / "sub").mkdir(parents=True)
    secret.mkdir()
    (photos / "plain.jpg").write_bytes(b"1")
    (photos / "sub" / "deep.jpg").write_bytes(b"2")
    (secret / "host.jpg").write_bytes(b"3")
    (photos / "to-inside.jpg").symlink_to(photos / "sub" / "deep.jpg")
    (photos / "to-outside.jpg").symlink_to(secret / "host.jpg")
    (photos / "sub" / "relative-out.jpg").symlink_to("../../secret/host.jpg")
    (photos / "sub-again").symlink_to(photos / "sub", target_is_directory=True)
    (photos / "sub" / "outdir").symlink_to(secret, target_is_directory=True)
    return photos


def test_a_folder_keeps_files_inside_it_and_refuses_links_out(tree):
    src = open_source(tree)
    kept = {r.path for r in src.records}
    refused = {r["path"] for r in src.rejected}
    assert {"plain.jpg", "sub/deep.jpg", "to-inside.jpg"} <= kept
    assert {"to-outside.jpg", "sub/relative-out.jpg"} <= refused
    # whatever a folder walk finds through links to folders: inside stays, outside is refused
    assert not any(path.startswith("sub/outdir/") for path in kept)
    assert all(r["error"] == OUTSIDE for r in src.rejected)
    assert not kept & refused
    followed = open_source(tree, follow_symlinks=True)
    assert {"to-outside.jpg", "sub/relative-out.jpg"} <= {r.path for r in followed.records} and not followed.rejected


def test_coco_names_that_climb_out_are_refused_and_missing_files_kept_for_the_decoder_to_report(tree):
    annotations = tree.parent / "captions.json"
    names = ["plain.jpg", "../secret/host.jpg", "sub/../../secret/host.jpg", "sub/outdir/host.jpg", "missing.jpg",
             "sub-again/deep.jpg"]
    annotations.write_text(json.dumps({"images": [{"id": i + 1, "file_name": n} for i, n in enumerate(names)],
                                       "annotations": []}))
    src = open_source(annotations, image_root=tree)
    assert [r.path for r in src.records] == ["plain.jpg", "missing.jpg", "sub-again/deep.jpg"]
    assert [r["path"] for r in src.rejected] == ["../secret/host.jpg", "sub/../../secret/host.jpg", "sub/outdir/host.jpg"]


def test_a_folder_lists_its_files_in_path_order_without_hidden_files_or_sidecars(tmp_path):
    for rel in ["b.jpg", "a-b/x.jpg", "a/x.jpg", "a/z/y.png", ".hidden.jpg", ".cache/c.jpg", "a/notes.txt",
                "a/meta.JSON", "odd.bin"]:
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_bytes(b"x")
    (tmp_path / "a" / "dead-link.jpg").symlink_to(tmp_path / "gone.jpg")
    src = open_source(tmp_path)
    # folders before the names that extend them ("a/" before "a-b/"), as sorting the path parts gives;
    # a file in a hidden folder is listed, a hidden file is not; other extensions go to the decoder
    assert [r.path for r in src.records] == [".cache/c.jpg", "a/x.jpg", "a/z/y.png", "a-b/x.jpg", "b.jpg", "odd.bin"]


def _read(fd):
    with open(fd, "rb") as f:
        return f.read()


def test_open_within_opens_regular_files_inside_the_roots_once(tree, monkeypatch):
    import os

    from paraseek.index import image_sources
    from paraseek.index.image_sources import open_within

    assert _read(open_within(tree / "plain.jpg", [tree])) == b"1"
    assert _read(open_within(tree / "to-inside.jpg", [tree])) == b"2"  # a link inside the root: its target
    assert open_within(tree / "to-outside.jpg", [tree]) is None
    os.mkfifo(tree / "pipe.jpg")  # refused at once: opened non-blocking, not a regular file
    assert open_within(tree / "pipe.jpg", [tree]) is None
    assert open_within(tree / "sub", [tree]) is None and open_within(tree, [tree]) is None
    # a file or a folder swapped for a link after the containment check: the walk from the root refuses it
    monkeypatch.setattr(image_sources, "resolve_within", lambda path, roots: path)
    assert open_within(tree / "to-outside.jpg", [tree]) is None
    assert open_within(tree / "sub" / "outdir" / "host.jpg", [tree]) is None
    assert _read(open_within(tree / "sub" / "deep.jpg", [tree])) == b"2"


def test_coco_metadata_of_unservable_types_is_refused_naming_the_image(tmp_path):
    from paraseek.index.image_sources import ImageSourceError
    from paraseek.index.metadata_fields import MetadataFieldError

    def coco(images, licenses=(), annotations=()):
        path = tmp_path / "captions.json"
        path.write_text(json.dumps({"images": images, "licenses": list(licenses), "annotations": list(annotations)}))
        return path

    src = open_source(coco([{"id": "7", "file_name": "a.jpg", "license": 5, "flickr_url": 12}],
                           licenses=[{"id": 5, "name": 4, "url": "https://l/5"}, {"id": [1], "name": "odd"}],
                           annotations=[{"image_id": 7, "caption": 3}, {"image_id": [7], "caption": "lost"}]))
    record = src.records[0]  # numbers where text belongs read as text, digits as ids
    assert (record.id, record.captions, record.flickr_url) == (7, ["3"], "12")
    assert record.license == {"id": 5, "name": "4", "url": "https://l/5"}
    with pytest.raises(MetadataFieldError, match=r"captions\.json images\[1\]: license\.name: text expected, got dict"):
        open_source(coco([{"id": 1, "file_name": "a.jpg"}, {"id": 2, "file_name": "b.jpg", "license": 1}],
                         licenses=[{"id": 1, "name": {"x": 1}}]))
    with pytest.raises(ImageSourceError, match=r"images\[0\]: id 'seven' is not an integer"):
        open_source(coco([{"id": "seven", "file_name": "a.jpg"}]))
    with pytest.raises(ImageSourceError, match=r"images\[0\]: an image entry needs a file_name"):
        open_source(coco([{"id": 1, "file_name": ["a.jpg"]}]))
