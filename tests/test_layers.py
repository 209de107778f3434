"""The package graph: every folder is one layer (installed as ``paraseek.<folder>``) and imports only
layers below it, and the serving path never imports torch. Checked statically over every import
statement (function-local ones included, so a lazy import cannot hide an upward dependency) and
dynamically in fresh interpreters."""

from __future__ import annotations

import ast
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# rank of each layer; equal ranks are siblings and must not import each other
LAYERS = {"core": 0, "paraphrase": 1, "index": 2, "evaluation": 3, "service": 4, "training": 4, "loadtests": 5, "paraseek": 6}
SERVING = ["core", "paraphrase", "index", "evaluation", "service"]


def layer_of(module: str) -> str | None:
    """The layer of an importable name: paraseek.<folder>... is that folder's, the rest of paraseek.* the
    top floor's, anything else (numpy, torch) none."""
    parts = module.split(".")
    if parts[0] != "paraseek":
        return None
    return parts[1] if len(parts) > 1 and parts[1] in LAYERS else "paraseek"


def imported_names(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module)
    return names


def imported_layers(path: Path) -> set[str]:
    return {layer for name in imported_names(path) if (layer := layer_of(name))}


def layer_files(layer: str) -> list[Path]:
    # the top floor's own modules only: paraseek/core, paraseek/service, ... are links to the layers
    return sorted((ROOT / layer).glob("*.py") if layer == "paraseek" else (ROOT / layer).rglob("*.py"))


def layer_graph() -> dict[str, dict[str, list[str]]]:
    """layer -> imported layer -> the modules that import it."""
    graph: dict[str, dict[str, list[str]]] = {}
    for layer in LAYERS:
        for path in layer_files(layer):
            for dep in imported_layers(path) - {layer}:
                graph.setdefault(layer, {}).setdefault(dep, []).append(path.relative_to(ROOT).as_posix())
    return graph


@pytest.mark.quick
def test_every_import_points_down():
    upward = [
        f"{module} ({layer}) imports {dep}"
        for layer, deps in layer_graph().items()
        for dep, modules in deps.items()
        if LAYERS[dep] >= LAYERS[layer]
        for module in modules
    ]
    assert not upward, "imports that do not point down:\n" + "\n".join(upward)


@pytest.mark.quick
def test_graph_checker_sees_function_local_imports(tmp_path):
    """The checker must catch an upward import hidden inside a function (the pattern this test forbids)."""
    module = tmp_path / "m.py"
    module.write_text("def f():\n    from paraseek.service.main import create_app\n    return create_app\n")
    assert imported_layers(module) == {"service"}


def test_nothing_imports_a_layer_by_its_folder_name():
    """The folders install only as paraseek.<folder>: an ``import core`` works in a checkout (the folder
    is on the path) and fails on every installed machine."""
    folders = set(LAYERS) - {"paraseek"}
    files = [p for layer in LAYERS for p in layer_files(layer)] + sorted((ROOT / "tests").rglob("*.py"))
    bare = [
        f"{path.relative_to(ROOT)}: {name}" for path in files for name in imported_names(path) if name.split(".")[0] in folders
    ]
    assert not bare, "imports by folder name instead of paraseek.<folder>:\n" + "\n".join(bare)


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts if parts[0] == "paraseek" else ["paraseek", *parts])


def _modules(layer: str) -> list[str]:
    # scripts are left out: importing them runs them
    return [module_name(p) for p in layer_files(layer) if p.stem not in ("__main__", "locustfile")]


def _imported_after(modules: list[str], env: dict | None = None, extra: str = "") -> set[str]:
    """The layers (paraseek.<folder>) and other top-level packages (torch) a fresh interpreter holds after
    importing ``modules``."""
    code = (
        "import importlib, json, sys\n"
        f"for m in {modules!r}:\n    importlib.import_module(m)\n{extra}\n"
        "print(json.dumps(sorted(sys.modules)))"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    # the package paraseek itself (its __init__) is every layer's parent, loaded with any of them
    return {layer_of(n) or n.split(".")[0] for n in json.loads(proc.stdout.strip().splitlines()[-1]) if n != "paraseek"}


@pytest.mark.parametrize("layer", SERVING)
def test_serving_layers_import_no_torch_and_nothing_above(layer):
    loaded = _imported_after(_modules(layer))
    above = {other for other, rank in LAYERS.items() if other != layer and rank >= LAYERS[layer]}
    assert not loaded & above, f"{layer} pulled in {loaded & above}"
    assert "torch" not in loaded, f"importing {layer} imported torch"


@pytest.mark.quick
def test_cli_and_training_entry_points_import_no_torch():
    loaded = _imported_after(["paraseek.cli", "paraseek.training", "paraseek.training.cli", "paraseek.training.embedded", "paraseek.training.recipe"])
    assert "torch" not in loaded


@pytest.mark.parametrize("args, layers", [(["--help"], set()), (["admin", "jobs", "--help"], {"service"})])
@pytest.mark.quick
def test_the_command_line_starts_without_the_layers_it_does_not_run(args, layers):
    """`paraseek --help` imports only the command line, and a layer's command only its layer's command
    module: every layer together (numpy, onnxruntime, faiss, fastapi, pydantic-settings) took 2.9 s to
    import. `paraseek admin` is an HTTP client: it starts without the index (numpy, faiss) too."""
    extra = ("import typer.main\nfrom paraseek.cli import app\n"
             f"typer.main.get_command(app).main({args!r}, prog_name='paraseek', standalone_mode=False)")
    loaded = _imported_after(["paraseek.cli"], extra=extra)
    assert loaded & set(LAYERS) - {"core", "paraseek"} == layers, loaded
    assert not loaded & {"numpy", "onnxruntime", "faiss", "fastapi", "torch", "pydantic_settings"}, loaded


def test_serve_startup_imports_no_torch(tmp_path, starter_bundle, starter_bank):
    """`paraseek serve` with a prebuilt starter: the embedded default is resolved and the app built
    without torch."""
    import os

    from paraseek.core.bundle import read_manifest
    from paraseek.paraphrase.caption_bank import bank_dir

    home = tmp_path / "home"
    shutil.copytree(starter_bundle, home / "bundles" / "starter")
    # a small bank where the default one goes: embedding all shipped captions takes ~90 s here, and
    # building a bank is the encoder's work, tested with the caption bank
    shutil.copytree(starter_bank.path, bank_dir(home, read_manifest(starter_bundle)))
    env = {**os.environ, "PARASEEK_HOME": str(home), "PARASEEK_STARTER": "plain"}
    extra = (
        "from paraseek.core.settings import Settings\nfrom paraseek.training.embedded import ensure_embedded_default\n"
        "from paraseek.service.main import create_app\ns = Settings()\nensure_embedded_default(s, progress=False)\ncreate_app(s)"
    )
    loaded = _imported_after(["paraseek.cli"], env=env, extra=extra)
    assert "torch" not in loaded
    assert (home / "snapshots" / "demo" / "current").is_file()


def module_graph(layer: str) -> dict[str, set[str]]:
    """module -> the modules of the same folder it imports (every import statement: function-local and
    type-checking-only ones included, since a cycle hidden in a function is still a cycle)."""
    graph: dict[str, set[str]] = {}
    for path in layer_files(layer):
        name = module_name(path)
        deps = graph.setdefault(name, set())
        deps.update(n for n in imported_names(path) if layer_of(n) == layer and n != name)
    return graph


def module_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    import graphlib

    try:
        tuple(graphlib.TopologicalSorter(graph).static_order())
    except graphlib.CycleError as exc:
        return list(exc.args[1])
    return None


@pytest.mark.parametrize("layer", list(LAYERS))
@pytest.mark.quick
def test_no_module_imports_itself_around_a_circle(layer):
    cycle = module_cycle(module_graph(layer))
    assert cycle is None, f"modules of {layer}/ import each other in a circle: {' -> '.join(cycle or [])}"


@pytest.mark.quick
def test_cycle_checker_sees_a_circle_through_a_lazy_import():
    a, b, c = "paraseek.index.a", "paraseek.index.b", "paraseek.index.c"
    assert module_cycle({a: {b}, b: {c}, c: {a}}) is not None
    assert module_cycle({a: {b}, b: set()}) is None
