"""The ``swarmgrad`` command line."""

from __future__ import annotations

import typer

from server.cli import app as coordinator_app

app = typer.Typer(
    help="Swarmgrad: train one PyTorch model on many volunteers' machines.", no_args_is_help=True
)
app.add_typer(coordinator_app, name="coordinator")


@app.command()
def demo(peers: int = typer.Option(5, help="How many local peers to start.")) -> None:
    """Start a handful of local peers that gossip, and print what each of them sees."""
    from peer.demo import run_demo

    run_demo(peers)
