"""What a snapshot version is, whichever backend holds it: its manifest, the draft a build publishes,
and the errors of building and loading one. The builder, the stores and the service share these."""

from __future__ import annotations

import os
import re
import socket
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from paraseek.core.errors import UserError
from paraseek.index.faiss_index import IndexSpec
from paraseek.index.filters import user_field_names

FORMAT_VERSION = 1


# what a version name may hold: safe in a Milvus filter expression and in an HTTP request's body
VERSION_TEXT = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")


class SnapshotError(UserError):
    """A snapshot is missing, altered, or does not fit the bundle it is used with."""


class BundleRef(BaseModel):
    name: str
    version: str
    image_space: str


class SnapshotManifest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    format_version: int = FORMAT_VERSION
    version: str
    created_at: str
    parent: str | None = None
    bundle: BundleRef
    image_space: str
    count: int
    dim: int
    index: IndexSpec
    recall_at_10: float | None = Field(None, description="vs exact search; None for exact indexes")
    recall_queries: int = 0
    tuning: dict | None = Field(None, description="--target-recall: the target, the setting chosen on tuning queries, "
                                "its speed, and where the queries came from; recall_at_10 is then measured on held-out ones")
    # provenance: which image source was indexed (kind, root, annotations)
    source: dict = Field(default_factory=dict)
    files: dict[str, str] = Field(default_factory=dict)
    backend: Literal["faiss", "milvus"] = "faiss"
    # where the version's index lives in its backend (milvus: the collection and its native index)
    location: dict = Field(default_factory=dict)
    user_fields: list[str] | None = Field(None, description="names of the user metadata fields a filter can test (None: "
                                          "written before manifests listed them; read off the metadata)")


class BuildError(UserError):
    """Nothing could be indexed."""


@dataclass
class VersionDraft:
    """Everything a new snapshot version is made of, before its index is built and it is published."""

    version: str
    vectors: np.ndarray
    ids: np.ndarray
    metadata: list[dict]
    provenance: dict  # the manifest's ``source``: which image source was indexed
    report: dict
    parent: str | None = None

    def manifest(self, ref: BundleRef, spec: IndexSpec, recall: float | None, n_queries: int, tuning: dict | None,
                 backend: str, location: dict | None = None, user_fields: list[str] | None = None) -> SnapshotManifest:
        return SnapshotManifest(
            version=self.version, created_at=datetime.now(UTC).isoformat(), parent=self.parent,
            bundle=ref, image_space=ref.image_space, count=len(self.ids), dim=int(self.vectors.shape[1]), index=spec,
            recall_at_10=recall, recall_queries=n_queries, tuning=tuning, source=self.provenance, backend=backend,
            location=location or {},
            user_fields=sorted(user_field_names(self.metadata)) if user_fields is None else user_fields,
        )


# -- what both backends do with versions: who is building one, and which to keep ---------------------
STALE_BUILD_AFTER_S = 6 * 3600  # a build on another host that never finished is given up after this


def build_owner() -> dict:
    """Who is building a version: recorded with the unfinished version (a FAISS staging folder's
    ``.owner``, a Milvus manifest row in state ``building``) so a cleaner tells a dead build from a live one."""
    return {"pid": os.getpid(), "host": socket.gethostname(), "started": time.time()}


def pid_alive(pid: int) -> bool:
    """Whether a process of this host is running."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, owned by someone else
        return True
    return True


def build_is_stale(owner: object, started: float | None = None, max_age_s: float = STALE_BUILD_AFTER_S) -> bool:
    """A build is stale when its writer is a process of this host that is gone, or it started longer
    than ``max_age_s`` ago (a writer on another host that never finished), or its owner record is
    unreadable (not written by a live build). ``started`` stands in for an owner without the field."""
    if not isinstance(owner, dict):
        return True
    try:
        mine = owner.get("host") == socket.gethostname()
        began = float(owner.get("started", started if started is not None else time.time()))
        return (mine and not pid_alive(int(owner["pid"]))) or time.time() - began > max_age_s
    except (ValueError, KeyError, TypeError):
        return True


def rollback_version(versions: list[str], current: str, parent_of_current: str | None) -> str | None:
    """The version a rollback from ``current`` returns to (``versions`` published, oldest first): its parent
    where that is still published, else the version published before it; None for the oldest."""
    if parent_of_current in versions:
        return parent_of_current
    at = versions.index(current) if current in versions else 0
    return versions[at - 1] if at > 0 else None


def versions_to_prune(versions: list[str], current: str | None, parent_of_current: str | None, keep: int) -> list[str]:
    """The oldest published versions beyond the newest ``keep`` (``versions`` sorted oldest first); never
    the current version or the one before it (its parent, or the previous version), which a rollback needs."""
    protected = {current}
    if current in versions:
        at = versions.index(current)
        protected |= {parent_of_current, versions[at - 1] if at > 0 else None}
    return [v for v in versions[: max(0, len(versions) - keep)] if v not in protected]
