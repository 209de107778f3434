"""paraseek index: embed an image collection with a bundle's image tower into versioned snapshots,
kept by one of two backends behind ``paraseek.index.store.SnapshotStore``: FAISS snapshot folders (the
default) or Milvus collections.

Runs on onnxruntime, faiss and numpy (no torch); pymilvus only when the Milvus backend is used. The
service uses ``store_from_settings(...).load(...)`` and the loaded version's ``search_ids``/``filtered``.
"""

from paraseek.core.cpu_threads import import_faiss

import_faiss()  # before any module of this package imports faiss: its OpenBLAS picks its kernel on load

from paraseek.index.backends import store_from_settings  # noqa: E402
from paraseek.index.faiss_index import IndexSpec  # noqa: E402
from paraseek.index.snapshot import Snapshot  # noqa: E402
from paraseek.index.store import SearchableSnapshot, SnapshotStore  # noqa: E402
from paraseek.index.versions import SnapshotError  # noqa: E402

__all__ = ["IndexSpec", "SearchableSnapshot", "Snapshot", "SnapshotError", "SnapshotStore", "store_from_settings"]
