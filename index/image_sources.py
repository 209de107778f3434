"""Image sources: an image folder, or a COCO-format captions/instances JSON plus its image folder."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path

from core.errors import UserError


class ImageSourceError(UserError):
    """The source cannot be indexed at all (missing, empty, malformed)."""


@dataclass
class ImageRecord:
    id: int  # stable int64: the COCO id where present, else derived from the relative path
    path: str  # relative to the source root
    coco_id: int | None = None
    captions: list[str] = field(default_factory=list)
    license: dict | None = None
    flickr_url: str | None = None
    coco_url: str | None = None


def path_id(relative_path: str) -> int:
    """A stable positive int64 id for an image path (same path, same id, across builds)."""
    digest = hashlib.sha1(relative_path.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") & 0x7FFF_FFFF_FFFF_FFFF


@dataclass
class ImageSource:
    root: Path
    records: list[ImageRecord]
    kind: str  # "folder" | "coco"
    annotations: Path | None = None
    # files refused before decoding ({path, error}): links or names that lead outside ``root``
    rejected: list[dict] = field(default_factory=list)


OUTSIDE = "resolves outside the source folder (a symlink or '..' path); not indexed"


def _inside(root: Path, relative: str) -> bool:
    """Whether ``root/relative``, links resolved, stays inside ``root`` (a symlink or a '../' name
    in a COCO file must not pull other files of the host into an index that the service serves)."""
    try:
        return (root / relative).resolve().is_relative_to(root.resolve())
    except (OSError, RuntimeError, ValueError):
        return False


def _confine(src: ImageSource, follow_symlinks: bool) -> ImageSource:
    if follow_symlinks:
        return src
    kept = []
    for rec in src.records:
        if _inside(src.root, rec.path):
            kept.append(rec)
        else:
            src.rejected.append({"path": rec.path, "error": OUTSIDE})
    src.records = kept
    return src


def _folder(root: Path) -> ImageSource:
    files = sorted(p for p in root.rglob("*") if p.is_file() and not p.name.startswith("."))
    records = []
    for p in files:
        rel = p.relative_to(root).as_posix()
        # Non-image extensions are still handed to the decoder (and reported if undecodable), except
        # obvious sidecar files.
        if p.suffix.lower() in {".json", ".md", ".txt", ".tsv", ".csv"}:
            continue
        records.append(ImageRecord(id=path_id(rel), path=rel))
    return ImageSource(root=root, records=records, kind="folder")


def _coco(annotations: Path, image_root: Path | None) -> ImageSource:
    try:
        data = json.loads(annotations.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ImageSourceError(f"cannot read COCO annotations {annotations}: {exc}") from exc
    if not isinstance(data, dict) or "images" not in data:
        raise ImageSourceError(f"{annotations} is not a COCO-format file (no 'images' list)")
    root = image_root or annotations.parent
    licenses = {lic["id"]: lic for lic in data.get("licenses", []) if "id" in lic}
    captions: dict[int, list[str]] = {}
    for ann in data.get("annotations", []):
        if "caption" in ann:
            captions.setdefault(ann["image_id"], []).append(ann["caption"].strip())
    records = []
    for img in data["images"]:
        lic = licenses.get(img.get("license"))
        records.append(
            ImageRecord(
                id=int(img["id"]),
                path=img["file_name"],
                coco_id=int(img["id"]),
                captions=captions.get(img["id"], []),
                license={"id": lic["id"], "name": lic.get("name"), "url": lic.get("url")} if lic else None,
                flickr_url=img.get("flickr_url"),
                coco_url=img.get("coco_url"),
            )
        )
    return ImageSource(root=root, records=records, kind="coco", annotations=annotations)


def open_source(source: str | Path, image_root: str | Path | None = None, follow_symlinks: bool = False) -> ImageSource:
    """``source`` is an image folder, or a COCO JSON (images in ``image_root``, default: beside it,
    or a folder next to it named like the split, e.g. ``val2017`` for ``captions_val2017.json``).

    Files whose real location is outside that folder are refused (listed in ``rejected``) unless
    ``follow_symlinks``."""
    source = Path(source)
    if not source.exists():
        raise ImageSourceError(f"source {source} does not exist")
    if source.is_dir():
        src = _folder(source)
    elif source.suffix.lower() == ".json":
        root = Path(image_root) if image_root else None
        if root is None:
            split = source.stem.split("_")[-1]
            candidate = source.parent / split
            root = candidate if candidate.is_dir() else source.parent
        src = _coco(source, root)
    else:
        raise ImageSourceError(f"source {source} is neither an image folder nor a COCO .json file")
    if not src.records:
        raise ImageSourceError(f"source {source} contains no images")
    src = _confine(src, follow_symlinks)
    if not src.records:
        raise ImageSourceError(f"source {source}: every file {OUTSIDE}")
    return src
