"""What every layer's command-line module shares: the consoles and the user-error mapping."""

from __future__ import annotations

import functools

import typer
from rich.console import Console

from paraseek.core.errors import EXIT_UNAVAILABLE, EXIT_USAGE, Unavailable, UserError

console = Console()
err = Console(stderr=True)


def user_errors(fn):
    """Turn the errors a user can cause (``UserError``, a missing file) into a one-line message and
    exit code 2, and an outage (``Unavailable``) into one and exit code 69, without a traceback. Other
    exceptions are bugs and keep theirs."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except (UserError, FileNotFoundError) as exc:
            err.print(f"[red]error:[/red] {exc}", highlight=False, soft_wrap=True)
            raise typer.Exit(EXIT_USAGE) from None
        except Unavailable as exc:
            err.print(f"[red]unavailable (retry later):[/red] {exc}", highlight=False, soft_wrap=True)
            raise typer.Exit(EXIT_UNAVAILABLE) from None

    return wrapper
