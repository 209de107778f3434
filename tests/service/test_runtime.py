"""The service's encoder is built from the settings: PARASEEK_PROVIDERS decides where it runs."""

from __future__ import annotations

import pytest

from paraseek.core.bundle import BundleError
from paraseek.core.settings import Settings
from paraseek.service.runtime import default_text_batch, load_encoder, text_sub_batch


@pytest.mark.quick
def test_providers_setting_places_the_encoder(starter_bundle, monkeypatch):
    import onnxruntime as ort

    enc = load_encoder(starter_bundle, Settings(providers="cpu"))
    assert enc.providers == ["CPUExecutionProvider"] and default_text_batch(enc) == 16
    assert text_sub_batch(enc, Settings()) == 3 and text_sub_batch(enc, Settings(encoder_sub_batch=16)) == 16
    monkeypatch.setattr(ort, "get_available_providers", lambda: ["CPUExecutionProvider"])  # an onnxruntime without CUDA
    with pytest.raises(BundleError, match="CUDAExecutionProvider"):
        load_encoder(starter_bundle, Settings(providers="cuda,cpu"))


@pytest.mark.quick
def test_a_cpu_only_providers_setting_keeps_the_search_on_the_cpu(starter_encoder):
    from paraseek.service.runtime import load_snapshot

    class Snapshot:
        def prepare_serving(self, **kwargs):
            pass

    class Store:
        def load(self, version, **kwargs):
            self.kwargs = kwargs
            return snapshot

    store, snapshot = Store(), Snapshot()
    assert load_snapshot(store, starter_encoder.image_space, Settings(providers="cpu")) is snapshot
    assert store.kwargs["use_gpu"] is False
    load_snapshot(store, starter_encoder.image_space, Settings(search_device="cpu"))
    assert store.kwargs["use_gpu"] is False
    load_snapshot(store, starter_encoder.image_space, Settings())  # unset: a GPU wherever one is usable
    assert store.kwargs["use_gpu"] is None


@pytest.mark.quick
def test_the_service_loads_a_flat_snapshot_with_its_quantized_copy_unless_told_not_to(tmp_path, monkeypatch):
    import paraseek.index.snapshot as snapshot_module
    from paraseek.index.snapshot import FaissStore
    from paraseek.service.runtime import load_snapshot
    from paraseek.index.quantized_scan import _available_cores, int8_products_exact
    from tests.index.test_memory_mapped import SPACE, build

    monkeypatch.setattr(snapshot_module, "SPLIT_SCAN_MIN_ROWS", 1000)  # the collection has 4K
    store = FaissStore(build(tmp_path, "flat"))
    served = load_snapshot(store, SPACE, Settings(home=tmp_path))
    # int8: a byte a dimension, and onnxruntime's packed copy of them (fp16 where this CPU's int8 product is not exact)
    assert served._scan_copy is not None and served.scan_copy_bytes == 4000 * 32 * 2
    assert served._scan_copy.codec == ("int8" if int8_products_exact() else "fp16")
    fp16 = load_snapshot(store, SPACE, Settings(home=tmp_path, flat_scan_copy="fp16"))
    assert fp16._scan_copy is not None and fp16.scan_copy_bytes == 4000 * 32 * 2
    if int8_products_exact():
        assert served._scan_copy._copy.session.get_session_options().intra_op_num_threads == _available_cores()
        one = load_snapshot(store, SPACE, Settings(home=tmp_path, faiss_batch_threads=1))  # the cores of merged searches
        assert one._scan_copy._copy.session.get_session_options().intra_op_num_threads == 1
    told = load_snapshot(store, SPACE, Settings(home=tmp_path, flat_scan_copy="off"))
    assert told._scan_copy is None and told.scan_copy_bytes == 0


def test_a_started_service_freezes_the_heap_unless_told_it_shares_the_process(make_settings):
    """freeze_heap (the default): once started, and after each swap, what the service has loaded is out of the
    cyclic collector's reach; off, the process's collector is left as it was (the service tests run so: in
    a process holding torch that start-up collection took 0.64 s)."""
    import gc
    import time
    from dataclasses import replace

    from fastapi.testclient import TestClient

    from paraseek.service.main import create_app

    try:
        for freeze in (True, False):
            gc.unfreeze()
            with TestClient(create_app(make_settings(freeze_heap=freeze))) as c:
                deadline = time.monotonic() + 60
                while c.get("/readyz").status_code != 200 and time.monotonic() < deadline:
                    time.sleep(0.1)  # the warm-up, which ends by freezing, runs beside the first requests
                assert c.get("/readyz").status_code == 200
                assert (gc.get_freeze_count() > 0) is freeze
                gc.unfreeze()
                engine = c.app.state.engine
                active = engine.active
                engine.swap(replace(active), replaces=active)  # what a reload or a reindex does
                assert (gc.get_freeze_count() > 0) is freeze
    finally:
        gc.unfreeze()  # nothing of these apps kept out of reach for the rest of the session
