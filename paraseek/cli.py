"""The ``paraseek`` command line: the top floor. It only assembles the commands each layer defines
next to its own code (``paraseek.index.cli``, ``paraseek.evaluation.cli``, ``paraseek.training.cli``,
``paraseek.loadtests.cli``, ``paraseek.service.cli``), plus ``serve`` and ``demo``, which put the
embedded default (``paraseek.training.embedded``) in front of the service and the index. Nothing here
imports torch: commands that need it import it when they run.

A layer's commands are imported when one of them runs (``LAYER_COMMANDS``): importing every layer
(numpy, onnxruntime, faiss, fastapi, pydantic-settings) took 2.9 s on a 2-core machine before
``paraseek --help`` printed anything, or ``paraseek admin jobs`` sent its one request.
"""

from __future__ import annotations

import importlib
import logging
from functools import cached_property
from typing import Any, List, Optional

import typer
import typer.main
from typer.core import TyperCommand, TyperGroup

from paraseek.core.cli_support import user_errors

# command -> ("module:attribute" of its Typer app or command function, its help line as the top-level
# help lists it without importing the module; tests/test_cli.py checks each against the command's own)
LAYER_COMMANDS: dict[str, tuple[str, str]] = {
    "train": ("paraseek.training.cli:train_cmd",
              "Train a text encoder from a recipe; resumes from the run directory's checkpoint; exports a bundle."),
    "models": ("paraseek.training.cli:models_app", "Build, export, quantise and inspect model bundles."),
    "index": ("paraseek.index.cli:app", "Build, update, inspect and search index snapshots."),
    "eval": ("paraseek.evaluation.cli:app", "Evaluate bundles: paraphrase consistency, retrieval, STS, perturbations."),
    "bench": ("paraseek.loadtests.cli:app", "Benchmarks (print side-by-side ratios measured in one run)."),
    "admin": ("paraseek.service.cli:app", "Drive a running service's admin API (PARASEEK_URL, PARASEEK_ADMIN_TOKEN): "
              "reindex, jobs, versions, rollback, reload."),
}


class LayerCommand(TyperCommand):
    """A layer's command (a Typer app, or one command function) standing in the top-level group until it
    runs: the group's help lists it by its help line, and running it imports its module."""

    def __init__(self, name: str, target: str, help_line: str):
        super().__init__(name, help=help_line)
        self.command_name, self.target = name, target

    @cached_property
    def loaded(self) -> TyperCommand | TyperGroup:
        module, attribute = self.target.split(":")
        obj = getattr(importlib.import_module(module), attribute)
        # registered in a group as the top level once registered it (add_typer, command), then taken out:
        # converted alone, an app would be a program of its own, with shell-completion options
        holder = typer.Typer(add_completion=False)
        holder.callback()(lambda: None)
        if isinstance(obj, typer.Typer):
            holder.add_typer(obj, name=self.command_name)
        else:
            holder.command(self.command_name)(obj)
        group = typer.main.get_command(holder)
        assert isinstance(group, TyperGroup)
        loaded = group.commands[self.command_name]
        assert isinstance(loaded, (TyperCommand, TyperGroup))
        return loaded

    def make_context(self, info_name, args, parent=None, **extra):  # unannotated: typer types it with its own click
        # the group runs the context's command: the loaded one, with its own parameters and help
        return self.loaded.make_context(info_name, args, parent=parent, **extra)


class LayeredGroup(TyperGroup):
    """The top-level group: its own commands (serve, demo) and ``LAYER_COMMANDS``, imported when run."""

    def __init__(self, **kwargs: Any):
        super().__init__(**kwargs)
        for name, (target, help_line) in LAYER_COMMANDS.items():
            self.commands.setdefault(name, LayerCommand(name, target, help_line))


app = typer.Typer(cls=LayeredGroup,
                  help="paraseek: text-to-image search whose answers stay the same when a user rephrases the query.",
                  no_args_is_help=True, add_completion=False)

DEMO_QUERIES = ["a dog playing outside", "people riding bikes in a city street", "a plate of food on a table"]


@app.callback()
def main(verbose: bool = typer.Option(False, "--verbose", "-v", help="Log at INFO level.")):
    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING, format="%(levelname)s %(name)s: %(message)s")


@app.command("serve")
@user_errors
def serve_cmd(
    host: str = typer.Option("127.0.0.1", help="Bind address (loopback by default)."),
    port: int = typer.Option(8000, min=1, max=65535),
):
    """Run the HTTP service; settings come from PARASEEK_* variables (PARASEEK_BUNDLE,
    PARASEEK_SNAPSHOT, PARASEEK_REDIS_URL, PARASEEK_ADMIN_TOKEN, ...).

    Without PARASEEK_BUNDLE/PARASEEK_SNAPSHOT it serves the embedded default (starter bundle + demo
    gallery), building them on first use.
    """
    from paraseek.core.settings import Settings
    from paraseek.service.main import run as run_service
    from paraseek.training.embedded import ensure_embedded_default, pending_first_answer, start_first_answer_build, with_embedded_defaults

    settings = Settings()
    pending, build = None, None
    if settings.embedded_default:
        # the first answer needs only the robust starter: its first-answer bundle is built beside the server,
        # which serves it once it is in place
        ensure_embedded_default(settings, first_answer_now=False)
        pending = pending_first_answer(settings)
        settings = with_embedded_defaults(settings)
        build = start_first_answer_build(settings) if pending is not None else None
    try:
        run_service(host=host, port=port, settings=settings, first_answer_pending=pending)
    finally:
        if build is not None and build.poll() is None:
            build.terminate()  # its staging folder goes at the next start's build


@app.command("demo")
@user_errors
def demo_cmd(
    queries: Optional[List[str]] = typer.Argument(None, help="Queries (default: three examples)."),
    k: int = typer.Option(3, "--k", "-k", min=1, max=76, help="Results per query."),
    rebuild: bool = typer.Option(False, help="Rebuild the starter bundle and the demo index."),
):
    """The embedded default: starter bundle + the bundled 76-photo COCO gallery, searched from the CLI.

    Builds the starter bundle and the demo index on first use (about a minute), then answers.
    """
    from paraseek.core.encoder import Encoder
    from paraseek.core.settings import Settings
    from paraseek.index.cli import print_results
    from paraseek.index.snapshot import Snapshot
    from paraseek.training.embedded import ensure_embedded_default

    bundle, snap_root = ensure_embedded_default(Settings(), rebuild, with_bank=False, first_answer_now=False)
    enc = Encoder(bundle, threads=1)
    snap = Snapshot.load(snap_root, image_space=enc.image_space, threads=1)
    queries = queries or DEMO_QUERIES
    for q, hits in zip(queries, snap.search(enc.encode_text(queries), k)):
        print_results(q, hits)


if __name__ == "__main__":
    app()
