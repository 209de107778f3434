"""The docs: a short README whose links resolve, and a site whose reference pages are generated from the
code (docs/hooks/reference.py) and build without a warning."""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _reference():
    spec = importlib.util.spec_from_file_location("docs_reference", ROOT / "docs" / "hooks" / "reference.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.quick
def test_readme_is_short_and_its_links_resolve():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 250
    targets = re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", readme)
    local = [t for t in targets if not t.startswith("http")]
    assert len(local) > 10 and [t for t in local if not (ROOT / t).exists()] == []
    # every page of the site's navigation is reachable from the README's map, generated ones aside
    nav_pages = re.findall(r":\s+(\S+\.md)\s*$", (ROOT / "mkdocs.yml").read_text(), flags=re.M)
    generated = set(_reference().GENERATED)
    assert [p for p in nav_pages if p not in generated and f"docs/{p}" not in readme] == []


@pytest.mark.quick
def test_cli_reference_lists_every_command_and_option():
    import typer

    from paraseek.cli import app

    ref = _reference()
    text = ref.cli_markdown()
    paths = ref.cli_command_paths()
    assert {"paraseek serve", "paraseek index build", "paraseek admin reindex", "paraseek bench load", "paraseek train"} <= set(paths)
    assert all(f"## `{p}`" in text for p in paths)
    build = typer.main.get_command(app).get_command(None, "index").loaded.get_command(None, "build")
    assert all(f"`{opt}`" in text for param in build.params if param.param_type_name == "option" for opt in param.opts)
    # a benchmark's options come from its own argparse parser
    assert "usage: paraseek bench index" in text and "--sizes" in text


@pytest.mark.quick
def test_settings_reference_lists_every_setting_with_what_it_does():
    from paraseek.core.settings import Settings

    rows = _reference().settings_rows()
    assert [r["env"] for r in rows] == [f"PARASEEK_{name.upper()}" for name in Settings.model_fields]
    assert [r["env"] for r in rows if not r["what"]] == []
    text = _reference().settings_markdown()
    assert "`PARASEEK_BUNDLE`" in text and "`PARASEEK_ADMIN_TOKEN`" in text


@pytest.mark.quick
def test_http_reference_is_the_services_openapi_schema():
    ref = _reference()
    schema = ref.openapi_schema()
    operations = ref.http_operations(schema)
    assert {"POST /v1/search", "POST /v1/embeddings", "POST /v1/admin/reindex", "GET /healthz"} <= set(operations)
    text = ref.http_markdown(schema)
    assert all(f"## `{op}`" in text for op in operations)
    assert "### SearchRequest" in text and "`consistency`" in text


def test_docs_site_builds_strict(tmp_path):
    """`mkdocs build --strict`: a broken link, a missing page or a docstring mkdocstrings cannot read
    fails; the generated pages and the results' plot are in the site."""
    proc = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-5000:]
    site = tmp_path / "site"
    for page in ("reference/cli", "reference/http", "reference/settings", "reference/python", "results/robust_starter"):
        assert (site / page / "index.html").is_file(), page
    assert (site / "results" / "robust_pareto.png").is_file()
    assert "A five-minute tour" in (site / "index.html").read_text()
