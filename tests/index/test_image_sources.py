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
