"""The docs site's pages that must not drift from the code, made from it at build time (mkdocs hooks).

- ``index.md`` is the README (its links into ``docs/`` made site-relative);
- ``reference/cli.md`` from the CLI's parsers (typer/click, and the argparse parsers of the benchmarks
  that pass their options through);
- ``reference/http.md`` from the service's OpenAPI schema;
- ``reference/settings.md`` from the ``Settings`` model;
- ``results/*`` are the tables of record in ``loadtests/results`` with their plots.

``mkdocs build --strict`` (CI) fails on a broken link, so a page that names a removed page fails too.
The functions are importable (tests/test_docs.py checks what they list against the code).
"""

from __future__ import annotations

import contextlib
import io
import json
import re
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "loadtests" / "results"
ENV_PREFIX = "PARASEEK_"


def _cell(text: Any) -> str:
    """One table cell: a single line, pipes escaped."""
    return " ".join(str(text).split()).replace("|", "\\|")


# ---------------------------------------------------------------- CLI


def cli_markdown() -> str:
    import typer

    from paraseek.cli import app
    from paraseek.loadtests.cli import PASS_THROUGH

    root = typer.main.get_command(app)
    out = ["# CLI reference", "",
           "Generated from the command's parsers at docs build time (`docs/hooks/reference.py`); "
           "`paraseek COMMAND --help` prints the same.", ""]
    for path, command in _commands(root, ["paraseek"]):
        out += _command_markdown(path, command, PASS_THROUGH.get(path[-1]) if path[:2] == ["paraseek", "bench"] else None)
    return "\n".join(out) + "\n"


def cli_command_paths() -> list[str]:
    """Every command's full name, as the reference lists them."""
    import typer

    from paraseek.cli import app

    return [" ".join(path) for path, _ in _commands(typer.main.get_command(app), ["paraseek"])]


def _commands(command, path: list[str]):
    # the top level's layer commands import their module when run (paraseek.cli.LayerCommand)
    command = getattr(command, "loaded", command)
    # typer carries its own copy of click: groups are known by what they do, not by click's classes
    if hasattr(command, "list_commands"):
        for name in command.list_commands(None):
            yield from _commands(command.get_command(None, name), [*path, name])
    else:
        yield path, command


def _command_markdown(path: list[str], command, argparse_main) -> list[str]:
    out = [f"## `{' '.join(path)}`", ""]
    if command.help:
        out += [_plain_help(command.help), ""]
    arguments = [p for p in command.params if p.param_type_name == "argument"]
    usage = " ".join([*path, "[OPTIONS]", *(p.name.upper() + ("..." if p.nargs == -1 else "")
                                             for p in arguments)])
    out += ["```", usage, "```", ""]
    options = [p for p in command.params if p.param_type_name == "option" and p.name != "help"]
    if arguments or options:
        out += ["| argument or option | type | default | what |", "|---|---|---|---|"]
        for p in arguments:
            out.append(f"| `{p.name.upper()}` | {_cell(_type_name(p, command))} | {'required' if p.required else ''} | "
                       f"{_cell(getattr(p, 'help', '') or '')} |")
        for p in options:
            names = ", ".join(f"`{n}`" for n in [*p.opts, *p.secondary_opts])
            default = "" if p.default is None or callable(p.default) or p.is_flag and not p.default else f"`{p.default}`"
            out.append(f"| {names} | {_cell(_type_name(p, command))} | {_cell(default)} | {_cell(p.help or '')} |")
        out.append("")
    if argparse_main is not None:
        out += ["Options (this benchmark's own parser):", "", "```", _argparse_help(argparse_main, path[-1]).rstrip(), "```", ""]
    return out


def _type_name(param, command) -> str:
    if getattr(param, "is_flag", False):
        return "flag"
    import typer._click.core as click_core  # typer's own click

    return param.display_type(click_core.Context(command)).strip("<>")


def _plain_help(text: str) -> str:
    # typer's "\b" keeps a paragraph unwrapped in the terminal; markdown needs none of it
    return "\n".join(line for line in text.replace("\b", "").splitlines()).strip()


def _argparse_help(main, name: str) -> str:
    buffer = io.StringIO()
    with contextlib.redirect_stdout(buffer), contextlib.suppress(SystemExit):
        main(["--help"])
    return re.sub(r"^usage: \S+", f"usage: paraseek bench {name}", buffer.getvalue())


# ---------------------------------------------------------------- settings


def settings_markdown() -> str:
    out = ["# Settings reference", "",
           f"Every setting is an environment variable `{ENV_PREFIX}<NAME>` (`core/settings.py`, read by the service, the "
           "CLI, training and the load tests alike). Generated from the `Settings` model at docs build time.", "",
           "| variable | type | default | what |", "|---|---|---|---|"]
    for row in settings_rows():
        out.append(f"| `{row['env']}` | {_cell(row['type'])} | {_cell(row['default'])} | {_cell(row['what'])} |")
    return "\n".join(out) + "\n"


def settings_rows() -> list[dict[str, str]]:
    from paraseek.core.settings import Settings

    rows = []
    for name, field in Settings.model_fields.items():
        if field.default_factory is not None:
            default = "computed"
        elif field.default is None:
            default = ""
        else:
            default = f"`{field.default.get_secret_value() if hasattr(field.default, 'get_secret_value') else field.default}`"
        rows.append({"env": ENV_PREFIX + name.upper(), "type": _annotation(field.annotation), "default": default,
                     "what": field.description or ""})
    return rows


def _annotation(annotation) -> str:
    text = getattr(annotation, "__name__", None) if not getattr(annotation, "__args__", None) else None
    text = text or str(annotation)
    return re.sub(r"\b(typing|pathlib|pydantic\.types)\.", "", text).replace("NoneType", "None")


# ---------------------------------------------------------------- HTTP API


def openapi_schema() -> dict:
    import tempfile

    from paraseek.core.settings import Settings
    from paraseek.service.main import create_app

    # the app is only assembled, never started: nothing is loaded, and a throwaway home takes what its
    # job store would write
    with tempfile.TemporaryDirectory() as home:
        return create_app(Settings(home=Path(home))).openapi()


def http_markdown(schema: dict | None = None) -> str:
    schema = schema or openapi_schema()
    components = schema.get("components", {}).get("schemas", {})
    out = ["# HTTP API reference", "",
           "Generated from the service's OpenAPI schema at docs build time; a running server serves the same schema at "
           "`/openapi.json` and an interactive page at `/docs`.", ""]
    for path, methods in schema["paths"].items():
        for method, op in methods.items():
            out += [f"## `{method.upper()} {path}`", ""]
            if op.get("summary"):
                out += [f"**{op['summary']}**", ""]
            if op.get("description"):
                out += [op["description"].strip(), ""]
            params = op.get("parameters", [])
            if params:
                out += ["| parameter | in | type | required | what |", "|---|---|---|---|---|"]
                for p in params:
                    out.append(f"| `{p['name']}` | {p['in']} | {_cell(_schema_type(p.get('schema', {})))} | "
                               f"{'yes' if p.get('required') else ''} | {_cell(p.get('description', ''))} |")
                out.append("")
            body = op.get("requestBody", {}).get("content", {})
            for content_type, content in body.items():
                out += [f"Request body ({content_type}): {_schema_type(content.get('schema', {}))}", ""]
            responses = op.get("responses", {})
            if responses:
                out += ["| status | what |", "|---|---|"]
                for status, response in responses.items():
                    shape = next((_schema_type(c.get("schema", {})) for c in response.get("content", {}).values()), "")
                    out.append(f"| {status} | {_cell(response.get('description', ''))}{' — ' + shape if shape else ''} |")
                out.append("")
    out += ["## Schemas", ""]
    for name, component in components.items():
        out += [f"### {name}", ""]
        if component.get("description"):
            out += [component["description"].strip(), ""]
        properties = component.get("properties", {})
        required = set(component.get("required", []))
        if properties:
            out += ["| field | type | required | default | what |", "|---|---|---|---|---|"]
            for field, spec in properties.items():
                default = f"`{json.dumps(spec['default'])}`" if "default" in spec else ""
                out.append(f"| `{field}` | {_cell(_schema_type(spec))} | {'yes' if field in required else ''} | "
                           f"{_cell(default)} | {_cell(spec.get('description', ''))} |")
            out.append("")
        elif "enum" in component:
            out += ["One of: " + ", ".join(f"`{v}`" for v in component["enum"]), ""]
    return "\n".join(out) + "\n"


def _schema_type(spec: dict) -> str:
    if "$ref" in spec:
        name = spec["$ref"].rsplit("/", 1)[-1]
        return f"[{name}](#{name.lower()})"
    for combiner in ("anyOf", "oneOf", "allOf"):
        if combiner in spec:
            return " or ".join(_schema_type(s) for s in spec[combiner])
    kind = spec.get("type", "")
    if kind == "array":
        return f"array of {_schema_type(spec.get('items', {}))}"
    if "enum" in spec:
        return " \\| ".join(f"`{v}`" for v in spec["enum"])
    return kind or "any"


def http_operations(schema: dict | None = None) -> list[str]:
    schema = schema or openapi_schema()
    return [f"{method.upper()} {path}" for path, methods in schema["paths"].items() for method in methods]


# ---------------------------------------------------------------- the README as the home page


def readme_as_home() -> str:
    text = (ROOT / "README.md").read_text()
    text = text.replace("](docs/", "](").replace("](loadtests/results/", "](results/")
    return text.replace("](LICENSE)", "](licences.md)")


# ---------------------------------------------------------------- mkdocs hooks

GENERATED = {"index.md": readme_as_home, "reference/cli.md": cli_markdown, "reference/http.md": http_markdown,
             "reference/settings.md": settings_markdown}


def on_files(files, config):
    from mkdocs.structure.files import File

    for uri, make in GENERATED.items():
        files.append(File.generated(config, uri, content=make()))
    for path in sorted(RESULTS.iterdir()):
        if path.suffix in (".md", ".png"):
            files.append(File.generated(config, f"results/{path.name}", abs_src_path=str(path)))
    return files
