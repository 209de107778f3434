"""The demo gallery's shipped vectors: what the first start indexes instead of encoding the photos."""

from pathlib import Path

import numpy as np

from paraseek.core.encoder import Encoder
from paraseek.index.demo import SHIPPED_ORIGIN, build_demo_snapshot, demo_vectors, shipped_demo_vectors
from paraseek.index.snapshot import Snapshot


def test_the_shipped_demo_vectors_are_the_starters_and_index_the_gallery_unencoded(embedded_starters, tmp_path):
    """They belong to the image tower of the starters a first start builds (robust and plain share it), equal
    what that tower makes of the photos now (else: ``python -m paraseek.index.demo BUNDLE`` writes them anew),
    and a demo build takes them all: nothing encoded, the same index as a build that encodes every photo."""
    shipped = shipped_demo_vectors()
    encoder = Encoder(embedded_starters / "starter-robust")
    # the tower id follows the weights' bytes: no source path of the checkout that exported them may be in them
    # (the exporter's stack traces named it, so every install path had another id and encoded the gallery again)
    import paraseek

    checkout = str(Path(paraseek.__file__).resolve().parent.parent).encode()
    for onnx_file in (embedded_starters / "starter-robust").glob("*.onnx"):
        assert checkout not in onnx_file.read_bytes(), onnx_file.name
    assert shipped is not None and shipped.tower_id == encoder.image_tower_id, "run python -m paraseek.index.demo BUNDLE"
    assert Encoder(embedded_starters / "starter").image_tower_id == shipped.tower_id
    fresh = demo_vectors(encoder, tmp_path / "encoded")
    assert fresh.digests.tolist() == shipped.digests.tolist() and len(fresh.digests) == 76
    assert fresh.widths.tolist() == shipped.widths.tolist() and fresh.heights.tolist() == shipped.heights.tolist()
    assert np.min(np.sum(fresh.vectors * shipped.vectors, axis=1)) >= 0.9999

    built = build_demo_snapshot(encoder, tmp_path / "shipped", progress=False)
    assert (built.report["encoded"], built.report["reused"], built.report["reused_from"]) == (0, 76, SHIPPED_ORIGIN)
    a, b = Snapshot.load(tmp_path / "shipped", use_gpu=False), Snapshot.load(tmp_path / "encoded", use_gpu=False)
    assert a.ids.tolist() == b.ids.tolist() and a.metadata_of(a.ids) == b.metadata_of(b.ids)
    queries = encoder.encode_text(["a dog on a beach", "a plate of food", "a train at a station"])
    assert a.search_ids(queries, 5)[1].tolist() == b.search_ids(queries, 5)[1].tolist()
