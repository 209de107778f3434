"""The order test modules are handed out in: longest first, each module's tests together and in order."""

from types import SimpleNamespace

import pytest

from tests.scheduling import MODULE_SECONDS, longest_first


@pytest.mark.quick
def test_modules_go_longest_first_and_unknown_ones_before_them():
    items = [SimpleNamespace(nodeid=n) for n in ("a.py::t1", "b.py::t1", "a.py::t2", "c.py::t1", "new.py::t1", "b.py::t2")]
    ordered = longest_first(items, {"a.py": 5.0, "b.py": 40.0, "c.py": 12.5})
    assert [i.nodeid for i in ordered] == ["new.py::t1", "b.py::t1", "b.py::t2", "c.py::t1", "a.py::t1", "a.py::t2"]


@pytest.mark.quick
def test_the_recorded_seconds_name_modules_that_exist(request):
    import json

    root = request.config.rootpath
    recorded = json.loads(MODULE_SECONDS.read_text())
    assert len(recorded) > 50 and all((root / module).is_file() for module in recorded), [m for m in recorded if not (root / m).is_file()]
