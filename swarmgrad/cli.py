"""The ``swarmgrad`` command: the root app and :func:`main`, which holds the error discipline.

Every expected failure (a :class:`~peer.exceptions.SwarmgradError`, a bad option, a missing
token, a file that cannot be written) ends as ONE line ``error: ...`` on standard error and
exit status 2 for usage errors, 1 otherwise, never a traceback; Ctrl-C exits with 130.

``kill -USR1 <pid>`` makes any ``swarmgrad`` process print every thread's stack to standard
error and go on.

``swarmgrad coordinator`` (``server.cli``) is imported only when that command runs: the
volunteer's commands never load ``server``, ``fastapi`` or ``sqlalchemy``, which only the
coordinator's extra installs.
"""

from __future__ import annotations

import contextlib
import faulthandler
import signal
import sys
from collections.abc import Sequence

import typer

from peer.exceptions import SwarmgradError
from swarmgrad import demo, join, organizer, relay, tokens
from swarmgrad.extras import require_coordinator

PROG_NAME = "swarmgrad"

app = typer.Typer(
    name=PROG_NAME,
    help="Swarmgrad: train one PyTorch model on many volunteers' machines.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
app.command("join")(join.join)
app.command("demo")(demo.demo)
app.command("relay")(relay.relay)
app.add_typer(organizer.runs_app, name="runs")
app.command("invite")(tokens.invite)
app.add_typer(tokens.tokens_app, name="tokens")


@app.command(
    "coordinator",
    # Everything after the command's name, --help included, goes to server.cli unparsed.
    context_settings={"allow_extra_args": True, "ignore_unknown_options": True},
    add_help_option=False,
)
def coordinator(ctx: typer.Context) -> None:
    """Run the coordinator (see `swarmgrad coordinator --help`)."""
    require_coordinator("coordinator")
    from server.cli import app as coordinator_app  # here, not at the top: see the docstring

    command = typer.main.get_command(coordinator_app)
    code = command.main(list(ctx.args), prog_name=ctx.command_path, standalone_mode=False)
    if isinstance(code, int) and code != 0:
        raise typer.Exit(code)


def error_line(message: object) -> str:
    """``message`` as the one line :func:`main` prints: ``error: ...``, whitespace folded."""
    text = " ".join(str(message).split())
    return f"error: {text or 'unknown error'}"


def _fail(message: object, code: int) -> None:
    sys.stderr.write(error_line(message) + "\n")
    sys.stderr.flush()
    sys.exit(code)


def main(argv: Sequence[str] | None = None) -> None:
    """Run the command line on ``argv`` (default: ``sys.argv[1:]``) and exit."""
    stderr = sys.__stderr__  # the process's own, even when a caller swapped sys.stderr
    if hasattr(signal, "SIGUSR1") and stderr is not None:  # not on Windows
        with contextlib.suppress(ValueError, OSError):  # no file descriptor to write to
            faulthandler.register(signal.SIGUSR1, file=stderr, all_threads=True)
    command = typer.main.get_command(app)
    try:
        # standalone_mode=False: errors come back to us instead of being printed by click
        # (as a box of several lines) or by Python (as a traceback).
        code = command.main(
            args=list(argv) if argv is not None else None,
            prog_name=PROG_NAME,
            standalone_mode=False,
        )
    except typer.Abort:
        sys.exit(1)  # click's answer to end-of-file at a prompt; it printed a newline
    except typer.TyperException as exc:  # click's ClickException and UsageError
        if type(exc).__name__ == "NoArgsIsHelpError":  # the help was printed already
            message = exc.format_message()
            if message:
                sys.stdout.write(message + "\n")
            sys.exit(2)
        _fail(exc.format_message(), getattr(exc, "exit_code", 1))
    except SwarmgradError as exc:
        _fail(exc, 1)
    except OSError as exc:  # the environment's refusal: disk full, no permission, port taken
        where = f"{exc.filename}: " if exc.filename else ""
        _fail(f"{where}{exc.strerror or exc}", 1)
    except KeyboardInterrupt:  # outside a command (typer turns one inside into exit 130)
        sys.exit(130)
    sys.exit(code if isinstance(code, int) else 0)
