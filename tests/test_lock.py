"""The application install is locked, the library keeps its ranges.

constraints.txt (written by .ci/relock) pins every distribution that install.sh installs; the
environment running these tests must hold exactly those, so that a dependency cannot be added, or
drift, without the lock saying so. The wheel users embed keeps pyproject.toml's ranges
(tests/test_packaging.py)."""

from __future__ import annotations

import tomllib
from importlib import metadata
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

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


def installed_distributions() -> dict[str, Version]:
    """name -> version of every distribution this interpreter can import, the project itself aside."""
    found: dict[str, Version] = {}
    for dist in metadata.distributions():
        name = canonicalize_name(dist.metadata["Name"])
        if name != PROJECT:
            found.setdefault(name, Version(dist.version))  # the first on sys.path is the one imported
    return found


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


def test_environment_holds_exactly_the_lock():
    problems = lock_mismatches(read_lock(LOCK.read_text()), installed_distributions())
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


