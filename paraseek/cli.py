"""The ``paraseek`` command line: the top floor. It only assembles the commands each layer defines
next to its own code (``paraseek.index.cli``, ``paraseek.evaluation.cli``, ``paraseek.training.cli``,
``paraseek.loadtests.cli``, ``paraseek.service.cli``), plus ``serve`` and ``demo``, which put the
embedded default (``paraseek.training.embedded``) in front of the service and the index. Nothing here
imports torch: commands that need it import it when they run.
"""

from __future__ import annotations

import logging
from typing import List, Optional

import typer

from paraseek.core.cli_support import user_errors
from paraseek.core.encoder import Encoder
from paraseek.core.settings import Settings
from paraseek.evaluation.cli import app as eval_app
from paraseek.index.cli import app as index_app
from paraseek.index.cli import print_results
from paraseek.index.snapshot import Snapshot
from paraseek.loadtests.cli import app as bench_app
from paraseek.service.cli import app as admin_app
from paraseek.service.main import run as run_service
from paraseek.training.cli import models_app, train_cmd
from paraseek.training.embedded import ensure_embedded_default, with_embedded_defaults

app = typer.Typer(help="paraseek: text-to-image search whose answers stay the same when a user rephrases the query.",
                  no_args_is_help=True, add_completion=False)
app.add_typer(models_app, name="models")
app.add_typer(index_app, name="index")
app.add_typer(eval_app, name="eval")
app.add_typer(bench_app, name="bench")
app.add_typer(admin_app, name="admin")
app.command("train")(train_cmd)

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
    settings = Settings()
    if settings.embedded_default:
        ensure_embedded_default(settings)
        settings = with_embedded_defaults(settings)
    run_service(host=host, port=port, settings=settings)


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
    bundle, snap_root = ensure_embedded_default(Settings(), rebuild, with_bank=False)
    enc = Encoder(bundle, threads=1)
    snap = Snapshot.load(snap_root, image_space=enc.image_space, threads=1)
    queries = queries or DEMO_QUERIES
    for q, hits in zip(queries, snap.search(enc.encode_text(queries), k)):
        print_results(q, hits)


if __name__ == "__main__":
    app()
