"""What every layer's command-line module shares: the consoles and the user-error mapping."""

from __future__ import annotations

import functools

import typer
from pydantic import ValidationError
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
        except ValidationError as exc:
            if exc.title != "Settings":
                raise  # another model refused what the code built: a bug
            for problem in exc.errors():  # the environment's PARASEEK_* variables
                name = "PARASEEK_" + "_".join(str(p) for p in problem["loc"]).upper()
                err.print(f"[red]error:[/red] {name} {problem['msg'].removeprefix('Value error, ')}", highlight=False,
                          soft_wrap=True)
            raise typer.Exit(EXIT_USAGE) from None

    return wrapper
