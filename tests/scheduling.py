"""Which test module runs first: the longest, so that the test processes end together.

pytest-xdist's ``loadscope`` hands a free process the next module in collection order (its own
reordering, by number of tests, is turned off in pyproject.toml). Handed out longest first (the LPT
rule), the last modules are short ones: by number of tests, one process ran the 60 s benchmark module
last and ended 95 s after another (931 s in all). ``MODULE_SECONDS`` holds each module's seconds in a
whole run on 2 cores; a module it does not know yet goes first (it may be long).
``pytest --record-module-seconds`` writes it anew from the run it ends."""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

import pytest

MODULE_SECONDS = Path(__file__).resolve().parent / "module_seconds.json"
_seconds: dict[str, float] = defaultdict(float)


def pytest_addoption(parser):
    parser.addoption("--record-module-seconds", action="store_true",
                     help=f"write each test module's seconds in this run to {MODULE_SECONDS.name} (a whole run)")


def module_of(nodeid: str) -> str:
    return nodeid.split("::", 1)[0]


def longest_first(items: list, seconds: dict[str, float]) -> list:
    """``items`` with each module's tests together, modules in falling order of ``seconds`` (unknown ones
    first), the order within a module kept."""
    modules: dict[str, list] = {}
    for item in items:
        modules.setdefault(module_of(item.nodeid), []).append(item)
    order = sorted(modules, key=lambda m: -seconds.get(m, float("inf")))
    return [item for module in order for item in modules[module]]


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config, items):
    seconds = json.loads(MODULE_SECONDS.read_text()) if MODULE_SECONDS.is_file() else {}
    items[:] = longest_first(items, seconds)


def pytest_runtest_logreport(report):
    _seconds[module_of(report.nodeid)] += report.duration


def pytest_sessionfinish(session, exitstatus):
    """In the process that saw every report: pytest-xdist's controller, or the one process of ``-n 0``."""
    if session.config.getoption("record_module_seconds") and not hasattr(session.config, "workerinput"):
        MODULE_SECONDS.write_text(json.dumps({m: round(s, 1) for m, s in sorted(_seconds.items())}, indent=0) + "\n")
