"""paraseek index: embed an image collection with a bundle's image tower into versioned FAISS snapshots.

Runs on onnxruntime, faiss and numpy (no torch). The service uses ``Snapshot.load`` and ``search``.
"""

from index.faiss_index import IndexSpec
from index.snapshot import Snapshot, SnapshotError

__all__ = ["IndexSpec", "Snapshot", "SnapshotError"]
