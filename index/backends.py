"""The index backends by name, and the store the settings choose (``PARASEEK_INDEX_BACKEND``)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

from paraseek.core.errors import UserError
from paraseek.core.settings import Settings
from paraseek.index.snapshot import FaissStore
from paraseek.index.store import SnapshotStore


def _faiss(settings: Settings, root: str | Path | None) -> SnapshotStore:
    return FaissStore(Path(root or settings.snapshot_root), memory_map=settings.index_memory_map)


def _milvus(settings: Settings, root: str | Path | None) -> SnapshotStore:
    from paraseek.index.milvus_store import MilvusStore  # pymilvus is imported only when Milvus is used

    return MilvusStore(settings.milvus_location,
                       token=settings.milvus_token.get_secret_value() if settings.milvus_token else None,
                       prefix=settings.milvus_collection, index_type=settings.milvus_index_type,
                       index_params=_json_setting(settings.milvus_index_params, "PARASEEK_MILVUS_INDEX_PARAMS"),
                       search_params=_json_setting(settings.milvus_search_params, "PARASEEK_MILVUS_SEARCH_PARAMS"),
                       timeout_s=settings.milvus_timeout_s, index_timeout_s=settings.milvus_index_timeout_s)


# name -> (settings, a FAISS root given on the command line) -> the store; every SnapshotStore
# implementation is one entry here (the build, the service, the CLI and the tests go through it)
BACKENDS: dict[str, Callable[[Settings, str | Path | None], SnapshotStore]] = {"faiss": _faiss, "milvus": _milvus}


def store_from_settings(settings: Settings, root: str | Path | None = None) -> SnapshotStore:
    """The store the settings name: PARASEEK_INDEX_BACKEND=faiss with PARASEEK_SNAPSHOT (or ``root``), or
    milvus with PARASEEK_MILVUS_URI, _TOKEN, _COLLECTION, _INDEX_TYPE, _INDEX_PARAMS, _SEARCH_PARAMS."""
    make = BACKENDS.get(settings.index_backend)
    if make is None:
        raise UserError(f"unknown index backend {settings.index_backend!r}: use one of {', '.join(BACKENDS)}")
    return make(settings, root)


def _json_setting(text: str | None, name: str) -> dict | None:
    if not text:
        return None
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise UserError(f"{name} is not valid JSON: {exc}") from exc
    if not isinstance(value, dict):
        raise UserError(f"{name} must be a JSON object")
    return value
