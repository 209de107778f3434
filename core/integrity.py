"""sha256 checksums of the files of a bundle or a snapshot version: computed at write, verified at load.

Hashing every file at every start costs a 10M-vector snapshot (22 GB) about half a minute. So, as
git's index does for its working tree, a folder keeps a record of what was verified (``.verified.json``:
each file's sha256 with its size, inode, mtime and ctime at the time): at load, a file whose stat still
matches its record, and whose mtime is older than the record by more than a timestamp's granularity
(git's "racy clean" rule), is taken as verified; any other file is hashed again. Writing, truncating,
replacing or copying a file changes its stat (a copy: the inode and ctime), so those are caught; a
change that keeps every stat field (bit rot, a deliberate forgery) is not, which is what
``trust_unchanged=False`` (``paraseek index verify``, ``PARASEEK_VERIFY=always``) is for. The record is
written where the folder is writable, and skipped where it is not: a read-only copy re-hashes."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from pathlib import Path

from paraseek.core.errors import UserError

log = logging.getLogger(__name__)

VERIFIED = ".verified.json"
# a file modified this soon before (or after) its record was taken may share the record's timestamp
# tick while its content differs: not trusted (coarse-clock and 2 s filesystems)
RACY_NS = 2_000_000_000


def sha256_file(path: Path, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def checksums(folder: Path, names: list[str] | tuple[str, ...]) -> dict[str, str]:
    return {name: sha256_file(Path(folder) / name) for name in names}


def _stat_key(st: os.stat_result) -> list[int]:
    return [st.st_size, st.st_ino, st.st_mtime_ns, st.st_ctime_ns]


def _read_record(folder: Path) -> dict:
    try:
        record = json.loads((folder / VERIFIED).read_text())
        return record if isinstance(record, dict) and isinstance(record.get("files"), dict) else {}
    except (OSError, ValueError):
        return {}  # none yet, unreadable or damaged: every file is hashed


def _unchanged(record: dict, name: str, digest: str, st: os.stat_result) -> bool:
    entry = record["files"].get(name)
    verified_at = record.get("verified_at_ns")
    return (isinstance(entry, dict) and isinstance(verified_at, int) and entry.get("sha256") == digest
            and entry.get("stat") == _stat_key(st) and st.st_mtime_ns < verified_at - RACY_NS)


def record_verified(folder: Path, digests: dict[str, str]) -> bool:
    """Note that the files ``digests`` names hold these sha256s now (just computed or verified); False
    where the folder is not writable. Written to a temporary file and renamed: a reader sees the old
    record or the new one."""
    folder = Path(folder)
    try:
        files = {name: {"sha256": digest, "stat": _stat_key((folder / name).stat())} for name, digest in digests.items()}
        tmp = folder / f"{VERIFIED}.tmp-{os.getpid()}"
        tmp.write_text(json.dumps({"verified_at_ns": time.time_ns(), "files": files}))
        os.replace(tmp, folder / VERIFIED)
        return True
    except OSError as exc:
        log.debug("cannot record verified checksums in %s: %s", folder, exc)
        return False


def verify_checksums(folder: Path, expected: dict[str, str], what: str, error: type[UserError], *,
                     trust_unchanged: bool = True) -> list[str]:
    """Raise ``error`` naming the first file under ``folder`` that is missing or differs from its sha256.
    Returns the names that were hashed: all of them, or with ``trust_unchanged`` only those not
    verified before and unchanged since (see the module docstring); a pass that hashed any records
    the result."""
    folder = Path(folder)
    record = _read_record(folder) if trust_unchanged else {}
    hashed = []
    for name, digest in expected.items():
        path = folder / name
        if not path.is_file():
            raise error(f"{what} {folder}: file {name!r} is missing")
        if record and _unchanged(record, name, digest, path.stat()):
            continue
        if sha256_file(path) != digest:
            raise error(f"{what} {folder}: file {name!r} does not match its sha256 (altered or truncated)")
        hashed.append(name)
    if hashed:
        record_verified(folder, expected)
    return hashed
