"""``index.versions``: which version a rollback returns to, and which versions pruning may remove."""

import pytest

from paraseek.index.versions import rollback_version, versions_to_prune

pytestmark = pytest.mark.quick


V = [f"v000{i}" for i in range(1, 6)]


def test_a_rollback_returns_to_the_parent_else_the_version_before():
    assert rollback_version(V, "v0005", "v0002") == "v0002"  # an update's parent, though others came between
    assert rollback_version(V, "v0005", None) == "v0004"  # a build has no parent
    assert rollback_version(V, "v0005", "v0000") == "v0004"  # its parent was pruned
    assert rollback_version(V, "v0003", None) == "v0002"  # rolled back once already: further back
    assert rollback_version(V, "v0001", None) is None


def test_pruning_never_removes_what_a_rollback_needs():
    assert versions_to_prune(V, "v0005", None, keep=2) == ["v0001", "v0002", "v0003"]
    assert versions_to_prune(V, "v0005", "v0002", keep=2) == ["v0001", "v0003"]
    assert versions_to_prune(V, "v0002", None, keep=2) == ["v0003"]  # rolled back: current and the one before stay
    for current, parent in (("v0005", "v0002"), ("v0005", None), ("v0003", None), ("v0002", "v0001")):
        kept = [v for v in V if v not in versions_to_prune(V, current, parent, keep=2)]
        assert current in kept and rollback_version(kept, current, parent) == rollback_version(V, current, parent)


def test_versions_past_v9999_are_named_and_sorted_by_number(tmp_path):
    from paraseek.index.snapshot import FaissStore
    from paraseek.index.store import next_version_name

    assert next_version_name(["v9999-20261207T000000Z-0a1b"]).startswith("v10000-")
    names = ["v10000-20261207T000002Z-0003", "v9999-20261207T000001Z-0002", "v0002-20261207T000000Z-0001"]
    for name in names:
        (tmp_path / "versions" / name).mkdir(parents=True)
    store = FaissStore(tmp_path)
    assert store.versions() == [names[2], names[1], names[0]]  # text order would put v10000 first
    assert versions_to_prune(store.versions(), names[0], None, keep=1) == [names[2]]  # the newest two stay
