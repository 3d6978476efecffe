"""`swarmgrad coordinator ...` commands."""

from __future__ import annotations

import typer

app = typer.Typer(help="Run the Swarmgrad coordinator.", no_args_is_help=True)
