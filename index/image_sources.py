"""Image sources: an image folder, a COCO-format captions/instances JSON plus its image folder, or
webdataset tar shards (``{00000..00099}.tar`` of ``KEY.jpg`` + ``KEY.txt``/``KEY.json``), whose
images are read in place from the tar files, never unpacked to disk."""

from __future__ import annotations

import hashlib
import io
import json
import os
import re
import stat
import tarfile
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from paraseek.core.errors import UserError
from paraseek.core.images import FileRange
from paraseek.core.memory import collection_paused
from paraseek.index.metadata_fields import MetadataFieldError, typed_fields


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
    url: str | None = None
    # an image inside a tar shard (``path``): the member's name and where its bytes lie in the file
    member: str | None = None
    offset: int | None = None
    size: int | None = None

    @property
    def location(self) -> str:
        """How a build's report names it: the path, or ``shard.tar:member``."""
        return f"{self.path}:{self.member}" if self.member else self.path


def path_id(relative_path: str) -> int:
    """A stable positive int64 id for an image path (same path, same id, across builds)."""
    digest = hashlib.sha1(relative_path.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") & 0x7FFF_FFFF_FFFF_FFFF


@dataclass
class ImageSource:
    root: Path
    records: list[ImageRecord]
    kind: str  # "folder" | "coco" | "webdataset"
    annotations: Path | None = None
    # files refused before decoding ({path, error}): links or names that lead outside ``root``
    rejected: list[dict] = field(default_factory=list)


OUTSIDE = "resolves outside the source folder (a symlink or '..' path); not indexed"


def resolve_within(path: str | Path, roots: Sequence[str | Path]) -> Path | None:
    """``path`` with every link resolved, if it lies inside one of ``roots`` (theirs resolved too), else
    None: a symlink, a '../' name in a COCO file or an absolute path in metadata must not pull other
    files of the host into an index that the service serves."""
    try:
        resolved = Path(path).resolve()
        return resolved if any(resolved.is_relative_to(Path(root).resolve()) for root in roots) else None
    except (OSError, RuntimeError, ValueError):
        return None


def open_within(path: str | Path, roots: Sequence[str | Path]) -> int | None:
    """A read-only descriptor of the regular file ``path`` names inside one of ``roots``, or None.
    Opened once, folder by folder from the root without following a link (a file swapped for a link
    after a check, or a folder for one, is refused rather than followed), and non-blocking (a FIFO
    swapped in is refused at ``fstat`` instead of hanging the reader): what is checked is what is read."""
    resolved = resolve_within(path, roots)
    if resolved is None:
        return None
    for root in roots:
        real_root = Path(root).resolve()
        if resolved.is_relative_to(real_root) and resolved != real_root:
            break
    else:
        return None
    *folders, name = resolved.relative_to(real_root).parts
    nofollow = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        at = os.open(real_root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        for folder in folders:
            inner = os.open(folder, nofollow | os.O_DIRECTORY, dir_fd=at)
            os.close(at)
            at = inner
        fd = os.open(name, nofollow | os.O_NONBLOCK, dir_fd=at)
    except OSError:  # ELOOP for a link, ENOENT, ENOTDIR, EACCES: nothing to serve
        return None
    finally:
        os.close(at)
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        return None
    return fd


def _confine(src: ImageSource, follow_symlinks: bool) -> ImageSource:
    if follow_symlinks:
        return src
    try:
        real_root = src.root.resolve()
    except (OSError, RuntimeError):
        real_root = None
    inside: dict[str, bool] = {}  # the members of one tar shard share its path: checked once
    real_dirs: dict[str, str] = {}  # each folder's links resolved once, not once per file in it

    def real_path(path: str) -> str:
        folder, name = os.path.split(path)
        try:
            link = stat.S_ISLNK(os.lstat(path).st_mode)
        except OSError:  # missing: resolved as a name, and reported when it is read
            link = True
        if link or name in ("", ".", ".."):
            return os.path.realpath(path)
        if folder not in real_dirs:
            real_dirs[folder] = os.path.realpath(folder)
        return os.path.join(real_dirs[folder], name)

    # real paths are absolute and normalised: a prefix test says what Path.is_relative_to says, without
    # parsing a Path per file (half the listing of a million-file folder)
    top = None if real_root is None else str(real_root)
    inner = None if top is None else os.path.join(top, "")

    def check(relative: str) -> bool:
        try:
            real = real_path(os.path.join(src.root, relative))
        except (OSError, RuntimeError, ValueError):
            return False
        return inner is not None and (real.startswith(inner) or real == top)

    kept = []
    for rec in src.records:
        ok = inside.get(rec.path)
        if ok is None:
            ok = inside[rec.path] = check(rec.path)
        if ok:
            kept.append(rec)
        else:
            src.rejected.append({"path": rec.path, "error": OUTSIDE})
    src.records = kept
    return src


SIDECAR_SUFFIXES = {".json", ".md", ".txt", ".tsv", ".csv"}


def _folder_files(root: Path) -> list[str]:
    """Paths of the files under ``root`` relative to it, in path order; hidden files left out. Links to
    files are listed (``_confine`` checks where they lead); links to folders are not entered."""
    found: list[str] = []
    pending = [(str(root), "")]
    while pending:
        folder, prefix = pending.pop()
        with os.scandir(folder) as entries:  # the entries' types come with the listing: no stat per file
            for entry in entries:
                if entry.is_dir(follow_symlinks=False):
                    pending.append((entry.path, f"{prefix}{entry.name}/"))
                elif not entry.name.startswith(".") and entry.is_file():
                    found.append(prefix + entry.name)
    return sorted(found, key=lambda rel: rel.split("/"))


def _folder(root: Path) -> ImageSource:
    records = []
    for rel in _folder_files(root):
        # Non-image extensions are still handed to the decoder (and reported if undecodable), except
        # obvious sidecar files.
        if os.path.splitext(rel)[1].lower() in SIDECAR_SUFFIXES:
            continue
        records.append(ImageRecord(id=path_id(rel), path=rel))
    return ImageSource(root=root, records=records, kind="folder")


def _coco(annotations: Path, image_root: Path | None) -> ImageSource:
    try:
        data = json.loads(annotations.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ImageSourceError(f"cannot read COCO annotations {annotations}: {exc}") from exc
    if not isinstance(data, dict) or not isinstance(data.get("images"), list):
        raise ImageSourceError(f"{annotations} is not a COCO-format file (no 'images' list)")
    root = image_root or annotations.parent

    def key(value):  # 7 and "7" are one id; a list or an object is none (and cannot key a dict)
        if isinstance(value, str) and value.strip().isdigit():
            return int(value)
        return value if isinstance(value, (int, str)) and not isinstance(value, bool) else None

    licenses = {key(lic.get("id")): lic for lic in _list(data, "licenses") if isinstance(lic, dict)}
    captions: dict[int | str | None, list] = {}
    for ann in _list(data, "annotations"):
        if isinstance(ann, dict) and "caption" in ann:
            captions.setdefault(key(ann.get("image_id")), []).append(ann["caption"])
    records = []
    for number, img in enumerate(data["images"]):
        where = f"{annotations.name} images[{number}]"
        if not isinstance(img, dict) or not isinstance(img.get("file_name"), str):
            raise ImageSourceError(f"{where}: an image entry needs a file_name")
        try:
            image_id = int(img.get("id"))  # type: ignore[arg-type]
        except (TypeError, ValueError):
            raise ImageSourceError(f"{where}: id {img.get('id')!r} is not an integer") from None
        lic = licenses.get(key(img.get("license"))) if key(img.get("license")) is not None else None
        fields = typed_fields({"captions": captions.get(image_id, []), "flickr_url": img.get("flickr_url"),
                               "coco_url": img.get("coco_url"),
                               "license": {"id": lic["id"], "name": lic.get("name"), "url": lic.get("url")} if lic else None},
                              where)
        records.append(
            ImageRecord(
                id=image_id,
                path=img["file_name"],
                coco_id=image_id,
                captions=[c.strip() for c in fields["captions"]],
                license=fields["license"],
                flickr_url=fields["flickr_url"],
                coco_url=fields["coco_url"],
            )
        )
    return ImageSource(root=root, records=records, kind="coco", annotations=annotations)


def _list(data: dict, name: str) -> list:
    value = data.get(name, [])
    if not isinstance(value, list):
        raise ImageSourceError(f"COCO annotations: {name!r} is a {type(value).__name__}, not a list")
    return value


IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".webp")
MAX_CAPTION_MEMBER_BYTES = 1 << 20  # a webdataset member's .txt or .json: captions and metadata, not documents


# shards one pattern may name: {0..999999999} would otherwise build a billion names before anything is read
MAX_PATTERN_SHARDS = 100_000


def expand_braces(pattern: str, limit: int = MAX_PATTERN_SHARDS) -> list[str]:
    """webdataset's shard patterns: ``shards/{00000..00009}.tar`` (zero padding kept) and ``{a,b}``;
    ``ImageSourceError`` past ``limit`` names, counted before they are made."""
    match = re.search(r"\{([^{}]*)\}", pattern)
    if not match:
        return [pattern]
    head, tail, body = pattern[: match.start()], pattern[match.end():], match.group(1)
    numeric = re.fullmatch(r"(\d+)\.\.(\d+)", body)
    if numeric:
        first, last = numeric.groups()
        if int(last) - int(first) + 1 > limit:
            raise ImageSourceError(f"{pattern}: names more than {limit} shards")
        width = len(first) if first.startswith("0") else 0
        options = [str(n).zfill(width) for n in range(int(first), int(last) + 1)]
    else:
        options = body.split(",")
    names: list[str] = []
    for option in options:
        names += expand_braces(head + option + tail, limit)
        if len(names) > limit:
            raise ImageSourceError(f"{pattern}: names more than {limit} shards")
    return names


def _tar_shard(root: Path, shard: Path, rejected: list[dict]) -> list[ImageRecord]:
    """Records of one webdataset shard: members grouped by key (name up to the first dot after the
    last slash); an image member with the caption of ``KEY.txt`` or ``KEY.json`` (caption/text, plus
    key/url/license). Only the tar headers are read here."""
    relative = shard.relative_to(root).as_posix()
    groups: dict[str, dict[str, tarfile.TarInfo]] = {}
    try:
        with tarfile.open(shard, mode="r:") as tar:  # uncompressed: members can be read in place
            for member in tar:
                if member.isfile():
                    folder, _, name = member.name.rpartition("/")
                    key, dot, ext = name.partition(".")
                    groups.setdefault(f"{folder}/{key}" if folder else key, {})[f"{dot}{ext}".lower()] = member
            texts: dict[str, dict[str, bytes]] = {}
            for k, g in groups.items():
                texts[k] = {}
                for ext, m in g.items():
                    if ext not in (".txt", ".json"):
                        continue
                    if m.size > MAX_CAPTION_MEMBER_BYTES:  # not read: a caption file's size is bounded
                        rejected.append({"path": f"{relative}:{m.name}", "error": f"{m.size} bytes, more than a "
                                         f"caption or metadata member may have ({MAX_CAPTION_MEMBER_BYTES}); left out"})
                        continue
                    texts[k][ext] = tar.extractfile(m).read()  # type: ignore[union-attr]
    except (tarfile.TarError, OSError) as exc:
        rejected.append({"path": relative, "error": f"not a readable tar shard: {exc}"})
        return []
    records = []
    for key, members in groups.items():
        image = next((m for ext, m in members.items() if ext in IMAGE_EXTENSIONS), None)
        if image is None:
            continue
        info: dict = {}
        if ".json" in texts[key]:
            try:
                loaded = json.loads(texts[key][".json"])
                info = loaded if isinstance(loaded, dict) else {}
            except (json.JSONDecodeError, UnicodeDecodeError):
                rejected.append({"path": f"{relative}:{key}.json", "error": "not JSON; the image is indexed without it"})
        try:
            fields = typed_fields({"captions": [info.get("caption") or info.get("text") or ""], "url": info.get("url"),
                                   "license": info.get("license") or info.get("LICENSE") or None}, f"{relative}:{key}.json")
        except MetadataFieldError as exc:  # one member's metadata: reported, the image indexed without it
            rejected.append({"path": f"{relative}:{key}.json", "error": f"{exc}; the image is indexed without its metadata"})
            fields = {"captions": [""]}
        caption = texts[key][".txt"].decode("utf-8", "replace").strip() if ".txt" in texts[key] else fields["captions"][0].strip()
        raw_key = str(info.get("key") or key.rpartition("/")[2])
        records.append(ImageRecord(
            id=int(raw_key) if raw_key.isdigit() else path_id(f"{relative}:{image.name}"), path=relative,
            captions=[caption] if caption else [], url=fields.get("url"), license=fields.get("license"),
            member=image.name, offset=image.offset_data, size=image.size,
        ))
    return records


def _webdataset(root: Path, shards: list[Path]) -> ImageSource:
    rejected: list[dict] = []
    records = [rec for shard in shards for rec in _tar_shard(root, shard, rejected)]
    return ImageSource(root=root, records=records, kind="webdataset", rejected=rejected)


def open_record(root: Path, record: ImageRecord) -> io.BufferedReader:
    """A record's bytes as a file of their own: the file, or its tar member read in place (no
    unpacking). ``OSError`` for a file that cannot be opened or a shard cut short of the member."""
    fd = os.open(root / record.path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        size = os.fstat(fd).st_size
        offset, length = (int(record.offset or 0), int(record.size or 0)) if record.member is not None else (0, size)
        if offset + length > size:
            raise OSError(f"{record.path}:{record.member} is truncated")
    except BaseException:
        os.close(fd)
        raise
    return io.BufferedReader(FileRange(fd, offset, length, closefd=True))


def source_paths(source: str | Path) -> list[Path]:
    """The paths a source names: every shard of a brace pattern, else the source itself."""
    if "{" in str(source) and str(source).endswith(".tar"):
        return [Path(p) for p in expand_braces(str(source))]
    return [Path(source)]


@collection_paused()  # a million records: no collections traversing them as they are made
def open_source(source: str | Path, image_root: str | Path | None = None, follow_symlinks: bool = False,
                within: Sequence[Path] | None = None) -> ImageSource:
    """``source`` is an image folder, or a COCO JSON (images in ``image_root``, default: beside it,
    or a folder next to it named like the split, e.g. ``val2017`` for ``captions_val2017.json``).

    Files whose real location is outside that folder are refused (listed in ``rejected``) unless
    ``follow_symlinks``. With ``within`` (the admin API's allowed roots), every path the source names
    (each shard of a pattern, the image folder) must resolve inside those roots when it is opened,
    not only when a request was checked: a link swapped in between is refused."""
    if within is not None:
        named = source_paths(source) + ([Path(image_root)] if image_root else [])
        if any(resolve_within(path, within) is None for path in named):
            raise ImageSourceError("the source resolves outside the allowed roots (PARASEEK_REINDEX_ROOT)")
    src = _open_source(source, image_root, follow_symlinks)
    if within is not None and resolve_within(src.root, within) is None:
        raise ImageSourceError("the source's image folder resolves outside the allowed roots (PARASEEK_REINDEX_ROOT)")
    return src


def _open_source(source: str | Path, image_root: str | Path | None, follow_symlinks: bool) -> ImageSource:
    if "{" in str(source) and str(source).endswith(".tar"):
        shards = source_paths(source)
        missing = [p for p in shards if not p.is_file()]
        if missing:
            raise ImageSourceError(f"shard {missing[0]} does not exist ({len(missing)} of {len(shards)} missing)")
        return _checked(_webdataset(Path(os.path.commonpath([p.parent for p in shards])), shards), source, follow_symlinks)
    source = Path(source)
    if not source.exists():
        raise ImageSourceError(f"source {source} does not exist")
    if source.is_file() and source.suffix == ".tar":
        return _checked(_webdataset(source.parent, [source]), source, follow_symlinks)
    if source.is_dir() and (shards := sorted(source.glob("*.tar"))) and not any(
            p.suffix.lower() in IMAGE_EXTENSIONS for p in source.iterdir()):
        return _checked(_webdataset(source, shards), source, follow_symlinks)
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
    return _checked(src, source, follow_symlinks)


def _checked(src: ImageSource, source, follow_symlinks: bool) -> ImageSource:
    if not src.records:
        raise ImageSourceError(f"source {source} contains no images")
    src = _confine(src, follow_symlinks)
    if not src.records:
        raise ImageSourceError(f"source {source}: every file {OUTSIDE}")
    return src
