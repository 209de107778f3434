"""The wheel users install: one top-level name, every module and data file of the repository's folders,
importable without the checkout, and pyproject.toml's ranges rather than the lock's pins."""

from __future__ import annotations

import os
import sysconfig
import tarfile
import venv
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[1]
RESEARCH = "loadtests/research/"
FOLDERS = ["core", "paraphrase", "index", "evaluation", "service", "training", "loadtests"]


BUILD = [sys.executable, "-m", "build", "--no-isolation"]


@pytest.fixture(scope="module")
def sdist(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("sdist")
    subprocess.run([*BUILD, "--sdist", "-o", str(out), str(ROOT)], check=True, capture_output=True, timeout=600)
    (path,) = out.glob("paraseek-*.tar.gz")
    return path


@pytest.fixture(scope="module")
def wheel(sdist, tmp_path_factory) -> Path:
    """Built as pip builds a release: from the sdist, unpacked (no git, no links, and no leftovers of
    this checkout's own build folder)."""
    out = tmp_path_factory.mktemp("wheel")
    with tarfile.open(sdist) as tf:
        tf.extractall(out / "unpacked", filter="data")
    (source,) = (out / "unpacked").iterdir()
    subprocess.run([*BUILD, "--wheel", "-o", str(out), str(source)], check=True, capture_output=True, timeout=600)
    (path,) = out.glob("paraseek-*.whl")
    return path


def test_wheel_installs_one_top_level_name(wheel):
    with zipfile.ZipFile(wheel) as zf:
        tops = {name.split("/")[0] for name in zf.namelist()}
    assert tops == {"paraseek", "paraseek-0.1.0.dist-info"}


@pytest.mark.quick
def test_wheel_holds_every_module_and_data_file_of_the_folders(wheel):
    """The links paraseek/<folder> are followed at build time: the wheel holds the files themselves."""
    with zipfile.ZipFile(wheel) as zf:
        names = set(zf.namelist())
    tracked = subprocess.run(["git", "ls-files", *FOLDERS], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    modules = [f for f in tracked if f.endswith(".py") and not f.startswith(RESEARCH)]
    assert len(modules) > 80
    missing = [f for f in modules if f"paraseek/{f}" not in names]
    assert not missing
    # what users run, not the research sweeps and results behind the numbers (they stay in the repository)
    research = [f for f in tracked if f.startswith((RESEARCH, "loadtests/results/"))]
    assert len(research) > 30 and [f for f in research if f"paraseek/{f}" in names] == []
    assert "paraseek-0.1.0.dist-info/licenses/LICENSE" in names
    for data in ("service/static/index.html", "core/demo/captions.json", "core/demo/vectors.npz", "training/recipes/robust-starter.yaml",
                 "paraphrase/data/ATTRIBUTION.md", "loadtests/grafana/paraseek-dashboard.json", "index/data/exact_scan.onnx",
                 "index/data/int8_products.onnx"):
        assert f"paraseek/{data}" in names, data
    # every shipped bank file (texts, vectors, query heads): the embedded default's first start reads them
    shipped = [f for f in tracked if f.startswith("paraphrase/data/")]
    assert any(f.endswith(".head.npz") for f in shipped) and [f for f in shipped if f"paraseek/{f}" not in names] == []
    assert sum(n.startswith("paraseek/core/demo/gallery/") and n.endswith(".jpg") for n in names) == 76


def test_unpacked_wheel_imports_without_the_checkout(wheel, tmp_path):
    """From the wheel's files alone (not the checkout, not the editable install): the layers import as
    paraseek.<folder>, their bare folder names do not exist, package data is found."""
    with zipfile.ZipFile(wheel) as zf:
        zf.extractall(tmp_path / "site")
    code = (
        "import importlib.util, paraseek, paraseek.core.demo, paraseek.service.main, paraseek.index.store\n"
        "from importlib.resources import files\n"
        "print(paraseek.__file__)\n"
        "print(files('paraseek.service').joinpath('static/index.html').is_file())\n"
        "print([m for m in ('core', 'service', 'index', 'training') if importlib.util.find_spec(m)])\n"
    )
    env = {**os.environ, "PYTHONPATH": str(tmp_path / "site")}
    # -P: the working directory (tmp_path) is not put on the path either
    proc = subprocess.run([sys.executable, "-P", "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    package_file, static_found, bare = proc.stdout.split("\n")[:3]
    assert Path(package_file).is_relative_to(tmp_path / "site")
    assert static_found == "True"
    assert bare == "[]"


@pytest.mark.quick
def test_wheel_keeps_ranges(wheel):
    """Users who embed the library resolve its ranges; only torch and torchvision are exact (the CPU
    build the tests run, and training/torch_env.py's workaround is written for that pair), and the dev
    extra's Milvus server (the last release of the package that ships the binary)."""
    with zipfile.ZipFile(wheel) as zf:
        meta = next(n for n in zf.namelist() if n.endswith(".dist-info/METADATA"))
        requires = [Requirement(line.split(":", 1)[1].strip()) for line in zf.read(meta).decode().splitlines()
                    if line.startswith("Requires-Dist:")]
    assert len(requires) > 40
    pinned = sorted(canonicalize_name(r.name) for r in requires if any(s.operator == "==" for s in r.specifier))
    assert pinned == ["milvus", "torch", "torchvision"]
    # the wheel carries pyproject.toml's ranges, not the lock's pins
    fastapi = [r for r in requires if canonicalize_name(r.name) == "fastapi"]
    assert fastapi and all(s.operator == ">=" for r in fastapi for s in r.specifier)


@pytest.mark.quick
def test_all_extra_holds_what_users_run_and_no_developer_tools(wheel):
    """``pip install paraseek[all]`` is the product (CPU flavour): the test runner, linters, the browser
    driver, the Milvus server binary and the pinned installer come only with ``dev``."""
    with zipfile.ZipFile(wheel) as zf:
        meta = zf.read(next(n for n in zf.namelist() if n.endswith(".dist-info/METADATA"))).decode()
    requires = [Requirement(line.split(":", 1)[1].strip()) for line in meta.splitlines() if line.startswith("Requires-Dist:")]

    def extra_names(extra: str) -> set[str]:
        return {canonicalize_name(r.name) for r in requires if r.marker is not None and r.marker.evaluate({"extra": extra})}

    (own,) = [r for r in requires if canonicalize_name(r.name) == "paraseek" and r.marker.evaluate({"extra": "all"})]
    assert "dev" not in own.extras and {"cpu", "serve", "train", "milvus"} <= set(own.extras)
    reachable = set().union(*(extra_names(e) for e in own.extras))
    assert {"onnxruntime", "fastapi", "torch", "pymilvus", "locust"} <= reachable
    assert reachable.isdisjoint({"pytest", "ruff", "mypy", "playwright", "milvus", "pip", "uv", "mkdocs-material"})
    assert {"pytest", "playwright", "milvus"} <= extra_names("dev")
    assert "Classifier: Operating System :: POSIX :: Linux" in meta and "License-Expression: Apache-2.0" in meta


def test_sdist_builds_a_wheel_that_installs_into_a_clean_environment(sdist, wheel, tmp_path):
    """The source distribution is self-contained (links followed, LICENSE in it, no git needed): the
    wheel built from it alone installs into a new virtual environment, whose ``paraseek`` runs from that
    environment with its package data. The clean environment borrows the already-installed dependencies
    through a path entry, never this checkout or its editable install."""
    with tarfile.open(sdist) as tf:
        names = tf.getnames()
        assert not [m.name for m in tf.getmembers() if m.issym() or m.islnk()]
    assert "paraseek-0.1.0/LICENSE" in names and not [n for n in names if "/.git/" in n]
    wheel_from_sdist = wheel
    env_dir = tmp_path / "clean"
    venv.create(env_dir, with_pip=False)
    python = env_dir / "bin" / "python"
    subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "-q", "--no-deps", str(wheel_from_sdist)],
                   check=True, capture_output=True, timeout=600)
    site = Path(subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                               check=True, capture_output=True, text=True).stdout.strip())
    # a .pth line adds a folder but runs none of the .pth files in it: the editable install stays out
    (site / "deps.pth").write_text(sysconfig.get_path("purelib") + "\n")
    code = ("import paraseek, paraseek.service.main\n"
            "from paraseek.core.demo import GALLERY_DIR\n"
            "print(paraseek.__file__)\n"
            "print(len(list(GALLERY_DIR.glob('*.jpg'))))\n")
    proc = subprocess.run([str(python), "-P", "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    package_file, photos = proc.stdout.split()
    assert Path(package_file).is_relative_to(site) and int(photos) == 76
    cli = subprocess.run([str(env_dir / "bin" / "paraseek"), "--help"], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert cli.returncode == 0 and "serve" in cli.stdout, cli.stderr[-3000:]
