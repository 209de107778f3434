"""Memory release helpers and the server's encoder settings."""

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from paraseek.core.encoder import Encoder


pytestmark = pytest.mark.quick


_RELEASE_SCRIPT = """
from paraseek.core.memory import limit_malloc_arenas, release_free_memory

def rss_mb():
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024

assert limit_malloc_arenas(2) is True
before = rss_mb()
# many small blocks (below the mmap threshold) stay in the heap after free unless trimmed
blocks = [bytearray(64 * 1024) for _ in range(4000)]
for b in blocks:
    b[0] = 1
grown = rss_mb()
del blocks, b
release_free_memory()
print(before, grown, rss_mb())
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc malloc")
def test_release_returns_freed_heap_to_the_os():
    # a fresh interpreter: in a test process, heap freed by earlier tests would be reused and hide the growth
    out = subprocess.run([sys.executable, "-c", _RELEASE_SCRIPT], capture_output=True, text=True, check=True,
                         cwd=Path(__file__).resolve().parents[2])
    before, grown, after = map(float, out.stdout.split())
    assert grown - before > 150 and after - before < (grown - before) / 2


_FREEZE_SCRIPT = """
import gc
from paraseek.core.memory import freeze_long_lived

class Node:
    pass

state = [Node() for _ in range(50_000)]  # the long-lived state: what a server loaded
freeze_long_lived()
assert gc.get_freeze_count() >= 50_000
# a full collection no longer looks at the frozen state
tracked = len(gc.get_objects())
assert tracked < 50_000, tracked

# what a reload replaced: a cycle frozen with the old state is freed by the next freeze_long_lived
a, b = Node(), Node()
a.other, b.other = b, a
import weakref
gone = weakref.ref(a)
freeze_long_lived()
del a, b
assert gone() is not None  # frozen: out of the collector's reach
freeze_long_lived()
assert gone() is None
print("ok")
"""


def test_freeze_long_lived_keeps_full_collections_off_the_loaded_state_and_frees_what_was_replaced():
    out = subprocess.run([sys.executable, "-c", _FREEZE_SCRIPT], capture_output=True, text=True, check=True,
                         cwd=Path(__file__).resolve().parents[2])
    assert out.stdout.strip() == "ok"


def test_collection_pauses_overlap_across_threads_and_restore_what_was_there():
    import gc
    import threading

    from paraseek.core.memory import collection_paused

    assert gc.isenabled()
    first_in, second_out = threading.Event(), threading.Event()

    def second() -> None:
        assert first_in.wait(10)
        with collection_paused():
            pass
        second_out.set()

    other = threading.Thread(target=second)
    other.start()
    with collection_paused():
        assert not gc.isenabled()
        first_in.set()
        assert second_out.wait(10)
        assert not gc.isenabled()  # the other thread's pause ended, this one has not
    other.join()
    assert gc.isenabled()

    @collection_paused()
    def paused_call(fail: bool) -> bool:
        if fail:
            raise ValueError("inside")
        return gc.isenabled()

    assert paused_call(False) is False and gc.isenabled()
    with pytest.raises(ValueError):
        paused_call(True)
    assert gc.isenabled()  # back on after an error too
    gc.disable()
    try:  # a collector someone else turned off stays off
        assert paused_call(False) is False and not gc.isenabled()
    finally:
        gc.enable()


def test_server_encoders_free_activations_after_each_call(starter_bundle, tmp_path):
    from paraseek.core.settings import Settings
    from paraseek.service.runtime import load_encoder

    enc = load_encoder(starter_bundle, Settings(home=tmp_path, precision="fp32"))
    assert enc.memory_arena is False
    assert enc._text_session.get_session_options().enable_cpu_mem_arena is False
    assert Encoder(starter_bundle, load_image=False)._text_session.get_session_options().enable_cpu_mem_arena is True
    # same numbers either way
    texts = ["a dog on a beach", "two people riding bikes"]
    assert np.allclose(enc.encode_text(texts), Encoder(starter_bundle, load_image=False).encode_text(texts), atol=1e-6)


def test_server_encoders_get_a_solo_session_on_every_core_for_lone_calls(starter_bundle, tmp_path, monkeypatch):
    from paraseek.core.settings import Settings
    from paraseek.service.runtime import load_encoder

    monkeypatch.setattr("os.cpu_count", lambda: 4)
    enc = load_encoder(starter_bundle, Settings(home=tmp_path, encoder_workers=2))
    assert (enc.threads, enc.solo_threads, enc.has_solo_session) == (2, 4, True)
    assert enc._solo_session.get_session_options().intra_op_num_threads == 4
    texts = ["a dog on a beach", "two people riding bikes"]
    plain, _ = enc.encode_text_detailed(texts)
    solo, _ = enc.encode_text_detailed(texts, solo=True)
    assert np.allclose(plain, solo, atol=1e-5)
    # the same graph: a graph swapped in by an exporter is swapped in both sessions
    assert enc.with_text_model(enc._text_path)._solo_session is not enc._solo_session

    off = load_encoder(starter_bundle, Settings(home=tmp_path, encoder_workers=2, encoder_solo=False))
    assert off.has_solo_session is False and np.allclose(off.encode_text_detailed(texts, solo=True)[0], plain, atol=1e-5)
    # one worker already has every core: no second session
    assert load_encoder(starter_bundle, Settings(home=tmp_path, encoder_workers=1)).has_solo_session is False


def _spin_config(session) -> tuple[bool, bool]:
    """(threads spin between operators, and stop spinning when a call returns)."""
    options = session.get_session_options()

    def entry(key: str) -> str | None:
        try:
            return options.get_session_config_entry(key)
        except RuntimeError:  # not set: onnxruntime's default
            return None

    return entry("session.intra_op.allow_spinning") != "0", entry("session.force_spinning_stop") == "1"


def test_server_encoders_sleep_between_calls_and_the_solo_session_spins_only_within_one(starter_bundle, tmp_path,
                                                                                      monkeypatch):
    from paraseek.core.settings import Settings
    from paraseek.service.runtime import load_encoder

    monkeypatch.setattr("os.cpu_count", lambda: 2)
    # the workers' sessions sleep: the event loop and the index need the cores; the solo session's
    # threads spin within a lone call and stop when it returns
    enc = load_encoder(starter_bundle, Settings(home=tmp_path, encoder_workers=2))
    assert (_spin_config(enc._text_session), _spin_config(enc._solo_session)) == ((False, False), (True, True))
    both = load_encoder(starter_bundle, Settings(home=tmp_path, encoder_workers=2, encoder_spin=True))
    assert (_spin_config(both._text_session), _spin_config(both._solo_session)) == ((True, False), (True, False))
    # a batch job's encoder spins as onnxruntime does by default
    assert _spin_config(Encoder(starter_bundle, load_image=False)._text_session) == (True, False)


def _cgroup_tree(tmp_path: Path, proc_line: str, files: dict[str, str]) -> tuple[str, str, str]:
    root = tmp_path / "cgroup"
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    (tmp_path / "cgroup-of-self").write_text(proc_line)
    (tmp_path / "meminfo").write_text("MemTotal: 25165824 kB\nMemAvailable: 20971520 kB\n")  # 20 GiB free on the host
    return str(tmp_path / "meminfo"), str(tmp_path / "cgroup-of-self"), str(root)


def test_available_memory_is_the_containers_room_under_a_cgroup_v2_limit(tmp_path):
    """A 4 GiB pod on a host with 20 GiB free: what the process may take is the pod's limit less its
    working set (usage less inactive file cache), not the host's free memory."""
    from paraseek.core.memory import available_memory_bytes, cgroup_memory_room

    gib = 2**30
    paths = _cgroup_tree(tmp_path, "0::/kubepods/pod1/ctr\n", {
        "kubepods/pod1/ctr/memory.max": f"{4 * gib}\n",
        "kubepods/pod1/ctr/memory.current": f"{3 * gib}\n",
        "kubepods/pod1/ctr/memory.stat": f"anon {2 * gib}\ninactive_file {gib}\n",
        "kubepods/pod1/memory.max": "max\n", "kubepods/pod1/memory.current": "1\n",
    })
    assert cgroup_memory_room(*paths[1:]) == 2 * gib
    assert available_memory_bytes(*paths) == 2 * gib
    # a tighter ancestor wins; a namespaced "/" path reads the mount's own files
    paths = _cgroup_tree(tmp_path / "ns", "0::/\n", {"memory.max": f"{gib}\n", "memory.current": f"{gib // 4}\n"})
    assert available_memory_bytes(*paths) == gib * 3 / 4


def test_available_memory_under_cgroup_v1_and_without_a_limit(tmp_path):
    from paraseek.core.memory import available_memory_bytes

    gib = 2**30
    v1 = _cgroup_tree(tmp_path, "4:memory:/docker/abc\n1:cpu:/docker/abc\n", {
        "memory/docker/abc/memory.limit_in_bytes": f"{6 * gib}\n",
        "memory/docker/abc/memory.usage_in_bytes": f"{gib}\n",
        "memory/docker/abc/memory.stat": "cache 0\ntotal_inactive_file 0\n",
    })
    assert available_memory_bytes(*v1) == 5 * gib
    # v1's "no limit" (2**63 - 4096) and v2's "max": the host's MemAvailable
    unlimited = _cgroup_tree(tmp_path / "u", "4:memory:/\n0::/\n", {
        "memory/memory.limit_in_bytes": "9223372036854771712\n", "memory/memory.usage_in_bytes": "5\n",
        "memory.max": "max\n", "memory.current": "5\n",
    })
    assert available_memory_bytes(*unlimited) == 20 * gib
    assert available_memory_bytes(str(tmp_path / "none"), str(tmp_path / "none"), str(tmp_path)) == 8 * gib
