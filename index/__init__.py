"""paraseek index: embed an image collection with a bundle's image tower into versioned snapshots,
kept by one of two backends behind ``paraseek.index.store.SnapshotStore``: FAISS snapshot folders (the
default) or Milvus collections.

Runs on onnxruntime, faiss and numpy (no torch); pymilvus only when the Milvus backend is used. The
service uses ``store_from_settings(...).load(...)`` and the loaded version's ``search_ids``/``filtered``.
"""

from paraseek.index.backends import store_from_settings
from paraseek.index.faiss_index import IndexSpec
from paraseek.index.snapshot import Snapshot
from paraseek.index.store import SearchableSnapshot, SnapshotStore
from paraseek.index.versions import SnapshotError

__all__ = ["IndexSpec", "SearchableSnapshot", "Snapshot", "SnapshotError", "SnapshotStore", "store_from_settings"]
