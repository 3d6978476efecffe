"""``swarmgrad join URL --token T``: a volunteer's peer, with a progress display.

The :class:`~peer.volunteer.Volunteer` runs in the main thread; SIGINT and SIGTERM ask it to
leave the swarm cleanly (a second signal quits at once). What the volunteer reports is shown
as a live table, or — with ``--quiet``, or when standard output is not a terminal — as lines
for a log: one per swarm epoch the peer reaches, plus one per notable event::

    epoch 12 | samples 3456 | 210.5 samples/s (swarm 830.1) | loss 0.412 | accuracy 0.913 | peers 4 | group 4 | coordinator ok

The rates are counted as the run's dashboard counts them: this peer's samples and the
swarm's, over the last seconds of this machine's clock (``-`` before a second of training).
"""

from __future__ import annotations

import contextlib
import enum
import logging
import os
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from types import FrameType, TracebackType
from typing import Annotated, Protocol, Self, TextIO

import typer
from rich.console import Console, Group
from rich.live import Live
from rich.table import Table
from rich.text import Text

from peer.coordinator import CoordinatorClient
from peer.tasks.shipped import Consent
from peer.volunteer import JoinOptions, Volunteer, VolunteerStatus, default_data_dir
from swarmgrad.errors import CommandError, UsageError

logger = logging.getLogger("swarmgrad.join")


class Device(enum.StrEnum):
    auto = "auto"
    cpu = "cpu"
    cuda = "cuda"


def join(
    url: Annotated[
        str, typer.Argument(help="The coordinator's URL, as in your invite.", show_default=False)
    ],
    token: Annotated[
        str,
        typer.Option(
            "--token",
            envvar="SWARMGRAD_JOIN_TOKEN",
            help="Your invite token.",
            show_envvar=True,
            show_default=False,
        ),
    ],
    task: Annotated[
        str | None,
        typer.Option(
            help="Train this task instead of the run's (digits, charlm or package.module:fn).",
            show_default=False,
        ),
    ] = None,
    device: Annotated[Device, typer.Option(help="Where to train.")] = Device.auto,
    name: Annotated[
        str | None,
        typer.Option(help="Your display name on the run's dashboard.", show_default=False),
    ] = None,
    host: Annotated[str, typer.Option(help="Interface to listen on for other peers.")] = "0.0.0.0",
    port: Annotated[
        int, typer.Option(min=0, max=65535, help="Port for other peers (0: any free one).")
    ] = 0,
    bulk_port: Annotated[
        int,
        typer.Option(min=0, max=65535, help="Port for tensor traffic (0: any free one)."),
    ] = 0,
    client_mode: Annotated[
        bool,
        typer.Option(help="Only dial out (behind NAT or a firewall that you cannot open)."),
    ] = False,
    upnp: Annotated[
        bool,
        typer.Option(
            help="Ask a UPnP home router to forward these ports while you train (removed "
            "when you leave).",
        ),
    ] = True,
    data_dir: Annotated[
        Path | None,
        typer.Option(
            help="Where this volunteer's key is kept, so a restart is the same peer; one "
            "process at a time (default: $XDG_DATA_HOME/swarmgrad or ~/.local/share/swarmgrad).",
            show_default=False,
        ),
    ] = None,
    quiet: Annotated[
        bool, typer.Option("--quiet", "-q", help="One log line per epoch instead of a table.")
    ] = False,
    verbose: Annotated[
        bool, typer.Option("--verbose", "-v", help="Log what the peer does (to stderr).")
    ] = False,
    trust_task: Annotated[
        bool,
        typer.Option(
            "--trust-task",
            help="Run the task file the run ships without asking (it is the organizer's "
            "code and runs with your permissions).",
        ),
    ] = False,
    task_sha256: Annotated[
        str | None,
        typer.Option(
            "--task-sha256",
            help="Run the task file the run ships only if its SHA-256 is this one (the "
            "organizer publishes it); any other is refused.",
            show_default=False,
        ),
    ] = None,
    save_final: Annotated[
        Path | None,
        typer.Option(
            "--save-final",
            help="When the run finishes or you leave, write this volunteer's final model "
            "(torch.save of {'model': state_dict with parameters and buffers, 'epoch', "
            "'task'}) to this file.",
            show_default=False,
            dir_okay=False,
        ),
    ] = None,
) -> None:
    """Join a training run as a volunteer and train until it finishes (Ctrl-C to leave)."""
    try:  # the client's own rules for a URL, before anything else happens
        CoordinatorClient(url).close()
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    if save_final is not None and not save_final.absolute().parent.is_dir():
        raise UsageError(f"--save-final: no directory {save_final.absolute().parent}")
    console = Console(highlight=False)
    display: Display = (
        LineDisplay(sys.stdout) if quiet or not console.is_terminal else LiveDisplay(console)
    )
    # Asked only when a person can answer; otherwise the flags decide (and refuse without).
    ask = display.ask if sys.stdin is not None and sys.stdin.isatty() else None
    options = JoinOptions(
        url=url,
        token=token,
        task=task,
        device=device.value,
        name=name,
        host=host,
        port=port,
        bulk_port=bulk_port,
        client_mode=client_mode,
        port_mapping=upnp,
        data_dir=data_dir if data_dir is not None else default_data_dir(),
        task_consent=Consent(trusted=trust_task, sha256=task_sha256, ask=ask),
        save_final=save_final,
    )
    volunteer = Volunteer(options, on_update=display.update)
    with (
        _logging_to_stderr(logging.INFO if verbose else logging.WARNING),
        display,
        _on_signals(volunteer.stop, display.note),
    ):
        try:
            message = volunteer.run()
        except ValueError as exc:
            # What the volunteer was given is wrong (a malformed token, a run config the task
            # refuses): a caller's mistake by the library's rules, told as one line here.
            logger.info("the volunteer refused its options", exc_info=True)
            raise CommandError(str(exc)) from exc
    display.final(message)


# ---------------------------------------------------------------------------- signals


@contextlib.contextmanager
def _on_signals(stop: Callable[[], None], note: Callable[[str], None]) -> Iterator[None]:
    """While inside: the first SIGINT/SIGTERM calls ``stop()``, a second one quits at once."""
    if threading.current_thread() is not threading.main_thread():
        yield  # signal handlers can only be set from the main thread
        return
    received = 0

    def handler(signum: int, frame: FrameType | None) -> None:
        nonlocal received
        received += 1
        if received > 1:
            os._exit(128 + signum)  # asked twice: no more waiting for a clean leave
        note("leaving the run... (press Ctrl-C again to quit at once)")
        stop()

    signals = (signal.SIGINT, signal.SIGTERM)
    previous = {s: signal.signal(s, handler) for s in signals}
    try:
        yield
    finally:
        for s, old in previous.items():
            signal.signal(s, old)


class _StderrHandler(logging.StreamHandler[TextIO]):
    """Writes to whatever ``sys.stderr`` is at the time (the live display redirects it)."""

    def __init__(self) -> None:
        super().__init__()

    @property
    def stream(self) -> TextIO:
        return sys.stderr

    @stream.setter
    def stream(self, value: TextIO) -> None:
        pass


@contextlib.contextmanager
def _logging_to_stderr(level: int) -> Iterator[None]:
    """While inside: log records of ``level`` and above go to stderr, one line each."""
    handler = _StderrHandler()
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    handler.setLevel(level)
    root = logging.getLogger()
    previous = root.level
    root.addHandler(handler)
    root.setLevel(min(level, previous) if previous else level)
    try:
        yield
    finally:
        root.removeHandler(handler)
        root.setLevel(previous)


# ---------------------------------------------------------------------------- displays


class Display(Protocol):
    def __enter__(self) -> Self: ...
    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None: ...
    def update(self, status: VolunteerStatus) -> None: ...
    def note(self, message: str) -> None: ...
    def final(self, message: str) -> None: ...
    def ask(self, what: str) -> bool: ...


def _ask(what: str) -> bool:
    """Whether the person at the terminal agrees to run the task file ``what`` describes."""
    typer.echo(f"This run ships its {what}.", err=True)
    typer.echo("It is the organizer's code and runs with your permissions.", err=True)
    return typer.confirm("Run it?", default=False, err=True)


def _number(value: float | None, digits: int = 3) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _rate(value: float | None) -> str:
    return "-" if value is None else f"{value:,.1f}"


def epoch_line(status: VolunteerStatus) -> str:
    """One log line for the status of a peer at a new epoch (the format of the module doc)."""
    parts = [
        f"epoch {status.epoch}",
        f"samples {status.samples}",
        f"{_number(status.samples_per_second, 1)} samples/s "
        f"(swarm {_number(status.swarm_samples_per_second, 1)})",
        f"loss {_number(status.loss)}",
    ]
    if status.metric_name:
        parts.append(f"{status.metric_name} {_number(status.eval_metric)}")
    parts += [
        f"peers {status.peers_online}",
        f"group {'-' if status.group_size is None else status.group_size}",
    ]
    if status.path:
        parts.append(f"path {status.path}")
    parts.append(f"coordinator {'ok' if status.coordinator_reachable else 'unreachable'}")
    if status.no_group:
        parts.append(status.no_group)
    return " | ".join(parts)


class _Events:
    """Which of a status's one-line events (message, reachability) are new."""

    def __init__(self) -> None:
        self.message: str | None = None
        self.reachability: str | None = None

    def new(self, status: VolunteerStatus) -> list[str]:
        lines = []
        if status.reachability and status.reachability != self.reachability:
            self.reachability = status.reachability
            lines.append(status.reachability)
        if status.message and status.message != self.message:
            self.message = status.message
            lines.append(status.message)
        return lines


class LineDisplay:
    """Lines for a log: one per new epoch (once the peer trained), one per event."""

    def __init__(self, out: TextIO) -> None:
        self.out = out
        self.events = _Events()
        self.epoch: int | None = None
        self.lock = threading.RLock()  # re-entered by a signal handler's note()

    def __enter__(self) -> LineDisplay:
        return self

    def __exit__(self, *exc_info: object) -> None:
        pass

    def _print(self, line: str) -> None:
        self.out.write(line + "\n")
        self.out.flush()

    def update(self, status: VolunteerStatus) -> None:
        with self.lock:
            for line in self.events.new(status):
                self._print(line)
            if status.samples > 0 and status.epoch != self.epoch:
                self.epoch = status.epoch
                self._print(epoch_line(status))

    def note(self, message: str) -> None:
        with self.lock:
            self._print(message)

    def final(self, message: str) -> None:
        with self.lock:
            if message != self.events.message:
                self._print(message)

    def ask(self, what: str) -> bool:
        with self.lock:
            return _ask(what)


class LiveDisplay:
    """A table redrawn in place; events are printed above it as they happen."""

    def __init__(self, console: Console) -> None:
        self.console = console
        self.events = _Events()
        self.status = VolunteerStatus()
        self.live = Live(self._render(), console=console, refresh_per_second=4, transient=False)

    def __enter__(self) -> LiveDisplay:
        self.live.__enter__()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.live.__exit__(exc_type, exc, tb)

    def _render(self) -> Group:
        status = self.status
        title = "Swarmgrad"
        if status.run_name:
            title += f" — run {status.run_name}"
        if status.task:
            title += f" ({status.task})"
        table = Table(title=title, show_header=False, title_justify="left", min_width=60)
        table.add_column(style="bold")
        table.add_column()
        rows = [
            ("state", status.state),
            ("epoch", str(status.epoch)),
            ("samples (this peer)", f"{status.samples:,}"),
            (
                "samples/s",
                f"{_rate(status.samples_per_second)} here, "
                f"{_rate(status.swarm_samples_per_second)} swarm",
            ),
            ("loss", _number(status.loss)),
            (status.metric_name or "eval metric", _number(status.eval_metric)),
            ("peers online", str(status.peers_online)),
            ("last group size", "-" if status.group_size is None else str(status.group_size)),
            (
                "compute utilisation",
                "-" if status.compute_utilisation is None else f"{status.compute_utilisation:.0%}",
            ),
            (
                "bytes sent/sample",
                "-" if status.bytes_per_sample is None else f"{status.bytes_per_sample:,.0f}",
            ),
            ("coordinator", "reachable" if status.coordinator_reachable else "unreachable"),
            ("this peer", status.reachability or "-"),
            ("path", status.path or "-"),
        ]
        if status.no_group:
            rows.append(("averaging", status.no_group))
        for name, value in rows:
            table.add_row(name, value)
        footer = Text("Ctrl-C to leave the run", style="dim")
        return Group(table, footer)

    def update(self, status: VolunteerStatus) -> None:
        for line in self.events.new(status):
            self.live.console.print(line, soft_wrap=True)
        self.status = status
        self.live.update(self._render())

    def note(self, message: str) -> None:
        self.live.console.print(message, soft_wrap=True)

    def final(self, message: str) -> None:
        if message != self.events.message:
            self.console.print(message, soft_wrap=True)

    def ask(self, what: str) -> bool:
        self.live.stop()  # the question and its answer stay above the table
        try:
            return _ask(what)
        finally:
            self.live.start()
