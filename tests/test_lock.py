"""The application install is locked, the library keeps its ranges.

constraints.txt (written by .ci/relock) pins every distribution that install.sh installs; every one of
them that this environment holds (``paraseek[all,dev]`` and what it requires, through the installed
metadata, and the installer's own pip, setuptools and wheel) must be the locked version, so that a
dependency cannot be added, or drift, without the lock saying so. A tool a developer adds beside them
(pytest-cov, ipython) is not the application's and is left alone. The wheel users embed keeps
pyproject.toml's ranges (tests/test_packaging.py)."""

from __future__ import annotations

import tomllib
from importlib import metadata
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

pytestmark = pytest.mark.quick


ROOT = Path(__file__).resolve().parents[1]
LOCK = ROOT / "constraints.txt"
PROJECT = "paraseek"


def read_lock(text: str) -> dict[str, Version]:
    """name -> pinned version; every requirement line of a lock is ``name==version``."""
    pins: dict[str, Version] = {}
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        req = Requirement(line)
        specs = list(req.specifier)
        if len(specs) != 1 or specs[0].operator != "==" or req.marker is not None:
            raise ValueError(f"line {number} is not a pin (name==version): {raw!r}")
        pins[canonicalize_name(req.name)] = Version(specs[0].version)
    return pins


# what install.sh installs: the installer and build backend first, then the project with every extra
INSTALLED_BY_INSTALL_SH = ("pip", "setuptools", "wheel", f"{PROJECT}[all,dev]")


def installed_requirement_closure(roots=INSTALLED_BY_INSTALL_SH) -> tuple[dict[str, Version], list[str]]:
    """name -> installed version of every distribution ``roots`` need, following each installed
    distribution's requirements (with the extras asked of it and the markers of this interpreter), the
    project itself aside; and the needed distributions that are not installed."""
    found: dict[str, Version] = {}
    missing: list[str] = []
    done: set[tuple[str, frozenset[str]]] = set()
    todo = [Requirement(r) for r in roots]
    while todo:
        req = todo.pop()
        name, extras = canonicalize_name(req.name), frozenset(req.extras)
        if (name, extras) in done:
            continue
        done.add((name, extras))
        try:
            dist = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            missing.append(name)
            continue
        if name != PROJECT:
            found[name] = Version(dist.version)
        for line in dist.requires or []:
            need = Requirement(line)
            if need.marker is None or any(need.marker.evaluate({"extra": extra}) for extra in extras | {""}):
                todo.append(need)
    return found, sorted(set(missing))


def lock_mismatches(pins: dict[str, Version], installed: dict[str, Version]) -> list[str]:
    problems = [f"{name} {version} is installed but not in the lock" for name, version in installed.items() if name not in pins]
    problems += [f"{name} {version} is installed, the lock pins {pins[name]}" for name, version in installed.items()
                 if name in pins and pins[name] != version]
    return sorted(problems)


def declared_requirements() -> list[Requirement]:
    """pyproject.toml's requirements: the base and every extra but the self-referencing ``all``."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    lines = list(project["dependencies"])
    for reqs in project["optional-dependencies"].values():
        lines += [r for r in reqs if canonicalize_name(Requirement(r).name) != PROJECT]
    return [Requirement(line) for line in lines]


def test_read_lock_takes_pins_and_refuses_ranges():
    pins = read_lock("# header\nTorch==2.13.0+cpu\n    # via paraseek\nsome_pkg==1.0\n")
    assert pins == {"torch": Version("2.13.0+cpu"), "some-pkg": Version("1.0")}
    with pytest.raises(ValueError, match="line 1 is not a pin"):
        read_lock("fastapi>=0.115\n")


def test_a_removed_or_moved_pin_is_reported():
    pins = {"fastapi": Version("0.120.0"), "numpy": Version("2.4.6")}
    assert lock_mismatches(pins, {"fastapi": Version("0.120.0"), "numpy": Version("2.4.6")}) == []
    assert lock_mismatches({"numpy": Version("2.4.6")}, {"fastapi": Version("0.120.0"), "numpy": Version("2.4.6")}) == [
        "fastapi 0.120.0 is installed but not in the lock"]
    assert lock_mismatches(pins, {"fastapi": Version("0.121.0"), "numpy": Version("2.4.6")}) == [
        "fastapi 0.121.0 is installed, the lock pins 0.120.0"]


def test_the_closure_follows_extras_and_markers_of_installed_metadata():
    found, missing = installed_requirement_closure(["packaging", "pytest"])
    assert set(found) >= {"packaging", "pytest", "pluggy", "iniconfig"} and missing == []
    assert "colorama" not in found  # pytest needs it on Windows only
    found, missing = installed_requirement_closure(["fastapi[standard]"])  # an extra this environment lacks
    assert "fastapi" in found and "fastapi-cli" in missing


def test_environment_holds_the_lock():
    found, missing = installed_requirement_closure()
    problems = lock_mismatches(read_lock(LOCK.read_text()), found) + [f"{name} is required but not installed" for name in missing]
    assert not problems, ("this environment is not the lock; install with `bash install.sh`, or lock a new "
                          "dependency with `.ci/relock --keep`:\n" + "\n".join(problems))


def test_lock_covers_every_declared_requirement_within_its_range():
    pins = read_lock(LOCK.read_text())
    problems = []
    for req in declared_requirements():
        name = canonicalize_name(req.name)
        if name not in pins:
            problems.append(f"{req} is declared in pyproject.toml but not locked")
        elif not req.specifier.contains(pins[name], prereleases=True):
            problems.append(f"{req} is declared, the lock pins {pins[name]}")
    assert not problems, "run `.ci/relock --keep`:\n" + "\n".join(problems)
    assert str(pins["torch"]).endswith("+cpu")  # the CPU build: PyPI's default is the CUDA one


