"""The organizer's commands for runs (``swarmgrad runs ...``) and what all of them share.

Shared with :mod:`swarmgrad.tokens` (``swarmgrad invite``, ``swarmgrad tokens ...``): the
``--url``/``--token``/``--json`` options, the client and the output.

Each is one or two calls of :class:`peer.coordinator.CoordinatorClient` and a rendering of the
answer — the coordinator's own payload types (:mod:`peer.formats.payloads`), so mypy checks
every field read here against the server's description of it: rich tables for people, or
with ``--json`` one JSON document on standard output for scripts. An answer the client cannot
parse ends, like every other failure, as one ``error:`` line (:mod:`swarmgrad.cli`). The
coordinator's URL and the organizer token come from ``--url``/``--token`` or
``SWARMGRAD_URL``/``SWARMGRAD_TOKEN`` (``swarmgrad coordinator admin-token`` makes a token).
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from pydantic_core import to_jsonable_python
from rich.console import Console
from rich.table import Table

from peer.coordinator import CoordinatorClient
from peer.formats.durations import parse_duration
from peer.formats.open_types import ConfigValues
from peer.formats.payloads import ProgressPublic, RunPublic
from swarmgrad.errors import CommandError, UsageError
from swarmgrad.shipping import RequirementOption, TaskFileOption, task_source

if TYPE_CHECKING:
    from peer.tasks.base import TrainingConfig
    from swarmgrad.shipping import TaskSource

DEFAULT_URL = "http://127.0.0.1:8000"

runs_app = typer.Typer(help="Create, list, inspect and steer training runs.", no_args_is_help=True)

UrlOption = Annotated[
    str,
    typer.Option(
        "--url",
        envvar="SWARMGRAD_URL",
        help="The coordinator's URL.",
        show_envvar=True,
    ),
]
TokenOption = Annotated[
    str | None,
    typer.Option(
        "--token",
        envvar="SWARMGRAD_TOKEN",
        help="An organizer token (`swarmgrad coordinator admin-token` prints one).",
        show_envvar=True,
        show_default=False,
    ),
]
JsonOption = Annotated[
    bool, typer.Option("--json", help="Print one JSON document instead of tables.")
]
RunArgument = Annotated[str, typer.Argument(help="The run's id.", show_default=False)]
MinVolunteersOption = Annotated[
    int | None,
    typer.Option(
        "--min-volunteers",
        min=1,
        max=1_000_000,
        help="Hold the run (paused) until this many volunteers are online, then start it by "
        "itself; a volunteer's machines count once.",
        show_default=False,
    ),
]


# ---------------------------------------------------------------------------- parsing


def parse_config(items: list[str]) -> dict[str, object]:
    """``["lr=0.1", "optimizer=adam"]`` → ``{"lr": 0.1, "optimizer": "adam"}``: a value is
    JSON when it parses as JSON, else the string as written. A later key wins."""
    config: dict[str, object] = {}
    for item in items:
        key, sep, raw = item.partition("=")
        key = key.strip()
        if not sep or not key:
            raise typer.BadParameter(f"{item!r} is not key=value", param_hint="'--config'")
        try:
            config[key] = json.loads(raw)
        except ValueError:
            config[key] = raw
    return config


def check_run_config(
    task_name: str, settings: ConfigValues, source: TaskSource | None = None
) -> TrainingConfig:
    """Load the task ``task_name`` here (from ``source``'s file when it ships one) and check
    ``settings`` against it as every volunteer will
    (:meth:`peer.tasks.base.TrainingConfig.from_run_config`): a run that no volunteer could
    train is a usage error before it exists, not one error per volunteer after. Returns the
    config the volunteers will train with."""
    from peer.tasks.base import TaskError, TrainingConfig
    from peer.tasks.registry import load_task

    try:
        task = source.load() if source is not None else load_task(task_name)
    except TaskError as exc:
        raise typer.BadParameter(
            f"{exc} (volunteers load it the same way; if it is installed on their machines "
            "only, --no-check creates the run without loading it here)",
            param_hint="'--task'",
        ) from None
    try:
        return TrainingConfig.from_run_config(task, settings)
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="'--config'") from None


def duration_option(text: str | None, option: str) -> float | None:
    """The seconds of an optional duration option (:func:`parse_duration`); a bad value is
    a usage error naming ``option``."""
    try:
        return None if text is None else parse_duration(text)
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint=f"'{option}'") from None


def require_token(token: str | None) -> str:
    if not token:
        raise UsageError(
            "no organizer token: pass --token or set SWARMGRAD_TOKEN "
            "(`swarmgrad coordinator admin-token` prints one)"
        )
    return token


@contextmanager
def open_client(url: str) -> Iterator[CoordinatorClient]:
    """A client for ``url``. The client raises ValueError only for what the caller passed —
    here what the person typed (a URL without http://, a token with spaces) — so that is a
    usage error."""
    try:
        with CoordinatorClient(url) as client:
            yield client
    except ValueError as exc:
        raise UsageError(str(exc)) from None


# ---------------------------------------------------------------------------- output


def emit(as_json: bool, document: object, render: Callable[[Console], None]) -> None:
    """``document`` (payloads, or dicts and lists of them) as JSON on stdout — each payload
    as the coordinator sent it — or ``render`` it for a person."""
    if as_json:
        typer.echo(json.dumps(to_jsonable_python(document), indent=2))
    else:
        render(Console(highlight=False))


def cell_text(value: object) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:,.4g}" if abs(value) < 1e4 else f"{value:,.0f}"
    if isinstance(value, int) and not isinstance(value, bool):
        return f"{value:,}"
    if isinstance(value, Mapping | list):
        return json.dumps(value)
    return str(value)


def _fields(title: str, rows: Mapping[str, object]) -> Table:
    table = Table(title=title, show_header=False, title_justify="left")
    table.add_column(style="bold")
    table.add_column(overflow="fold")
    for name, value in rows.items():
        table.add_row(name, cell_text(value))
    return table


def _status(run: RunPublic) -> str:
    """The run's status, and why where the coordinator says: "paused: waiting for 3
    volunteers (1 online)", "finished: reached its last epoch 40"."""
    detail = run.status_detail
    return run.status.value if not detail else f"{run.status.value}: {detail}"


def _run_rows(run: RunPublic) -> dict[str, object]:
    rows: dict[str, object] = {
        "id": run.id,
        "name": run.name,
        "task": run.task,
        "status": _status(run),
        "config": run.config,
        "created": run.created_at,
    }
    if run.task_file is not None:
        shipped = run.task_file
        rows["task file"] = f"{shipped.filename}, {shipped.size:,} bytes"
        rows["task sha256"] = shipped.sha256
        rows["requirements"] = ", ".join(shipped.requirements) or "-"
    return rows


# ---------------------------------------------------------------------------- runs


@runs_app.command("create")
def create(
    name: Annotated[str, typer.Argument(help="A name people recognise the run by.")],
    task: Annotated[
        str | None,
        typer.Option(
            "--task",
            help="The task peers train, installed on their machines: digits, charlm or "
            "package.module:function.",
            show_default=False,
        ),
    ] = None,
    task_file: TaskFileOption = None,
    requirement: RequirementOption = None,
    config: Annotated[
        list[str] | None,
        typer.Option(
            "--config",
            help="A hyper-parameter as key=value (value parsed as JSON if it is JSON); "
            "repeat for more.",
            show_default=False,
        ),
    ] = None,
    no_check: Annotated[
        bool,
        typer.Option(
            "--no-check",
            help="Create the run without loading its task here to check the config (for a "
            "task installed on the volunteers' machines only).",
        ),
    ] = False,
    min_volunteers: MinVolunteersOption = None,
    url: UrlOption = DEFAULT_URL,
    token: TokenOption = None,
    as_json: JsonOption = False,
) -> None:
    """Create a run. Next: `swarmgrad invite RUN` for the volunteers."""
    settings = parse_config(config or [])
    if task is None and task_file is None:
        raise UsageError("give the run's task: --task NAME, or --task-file FILE to ship it")
    source = task_source(task, task_file, requirement or [], default="digits")
    token = require_token(token)
    if not no_check:
        checked = check_run_config(source.task, settings, source)
        if "epochs" not in settings and checked.epochs is not None:
            # The task's own last epoch, written down: the coordinator finishes the run there.
            settings["epochs"] = checked.epochs
    with open_client(url) as client:
        run = client.create_run(
            token,
            name,
            source.task,
            settings,
            min_volunteers=min_volunteers,
            task_file=source.body,
        )

    def render(console: Console) -> None:
        console.print(_fields(f"Created run {run.name}", _run_rows(run)))
        if run.min_volunteers is not None:
            console.print(
                f"It starts by itself once {run.min_volunteers} volunteers are online "
                f"(`swarmgrad runs resume {run.id}` starts it now).",
                soft_wrap=True,
            )
        console.print(f"Next: swarmgrad invite {run.id}", soft_wrap=True)

    emit(as_json, run, render)


@runs_app.command("list")
def list_runs(url: UrlOption = DEFAULT_URL, as_json: JsonOption = False) -> None:
    """List the runs, newest first."""
    with open_client(url) as client:
        runs = client.list_runs()

    def render(console: Console) -> None:
        if not runs:
            console.print("No runs yet. Create one with `swarmgrad runs create NAME --task T`.")
            return
        table = Table(title="Runs", title_justify="left")
        for column in ("id", "name", "task", "status", "created"):
            table.add_column(column, overflow="fold")
        for run in runs:
            table.add_row(run.id, run.name, run.task, _status(run), cell_text(run.created_at))
        console.print(table)

    emit(as_json, runs, render)


def _progress_rows(progress: ProgressPublic) -> dict[str, object]:
    checkpoint = progress.checkpoint
    return {
        "epoch": progress.epoch,
        "samples": progress.samples,
        "samples/s": progress.samples_per_second,
        "peers online": progress.peers_online,
        "loss": progress.loss,
        "eval metric": progress.eval_metric,
        "rounds done": progress.rounds_done,
        "rounds failed": progress.rounds_failed,
        "recent group sizes": ", ".join(str(s) for s in progress.recent_group_sizes) or None,
        "checkpoint": (
            f"epoch {checkpoint.epoch}, {checkpoint.size:,} bytes, {checkpoint.created_at}"
            if checkpoint is not None
            else None
        ),
    }


@runs_app.command("show")
def show(run_id: RunArgument, url: UrlOption = DEFAULT_URL, as_json: JsonOption = False) -> None:
    """Show a run and its progress."""
    with open_client(url) as client:
        run = client.run(run_id)
        progress = client.progress(run_id)

    def render(console: Console) -> None:
        console.print(_fields(f"Run {run.name}", _run_rows(run)))
        console.print(_fields("Progress", _progress_rows(progress)))

    emit(as_json, {"run": run, "progress": progress}, render)


def _set_status(
    run_id: str,
    status: str,
    url: str,
    token: str | None,
    as_json: bool,
    *,
    min_volunteers: int | None = None,
) -> None:
    token = require_token(token)
    with open_client(url) as client:
        if min_volunteers is None:
            run = client.update_run(token, run_id, status=status)
        else:
            run = client.update_run(token, run_id, min_volunteers=min_volunteers)
    emit(
        as_json,
        run,
        lambda console: console.print(f"Run {run.name} ({run.id}) is {_status(run)}."),
    )


@runs_app.command("pause")
def pause(
    run_id: RunArgument,
    min_volunteers: MinVolunteersOption = None,
    url: UrlOption = DEFAULT_URL,
    token: TokenOption = None,
    as_json: JsonOption = False,
) -> None:
    """Pause a run: volunteers stop training and wait (with --min-volunteers, until that
    many are online: it then resumes by itself, at once if they are)."""
    _set_status(run_id, "paused", url, token, as_json, min_volunteers=min_volunteers)


@runs_app.command("resume")
def resume(
    run_id: RunArgument,
    url: UrlOption = DEFAULT_URL,
    token: TokenOption = None,
    as_json: JsonOption = False,
) -> None:
    """Resume a paused run (one waiting for volunteers starts now)."""
    _set_status(run_id, "running", url, token, as_json)


@runs_app.command("finish")
def finish(
    run_id: RunArgument,
    url: UrlOption = DEFAULT_URL,
    token: TokenOption = None,
    as_json: JsonOption = False,
) -> None:
    """Finish a run (final): volunteers leave."""
    _set_status(run_id, "finished", url, token, as_json)


@runs_app.command("checkpoint")
def checkpoint(
    run_id: RunArgument,
    output: Annotated[
        Path | None,
        typer.Option(
            "--output",
            "-o",
            help="Where to write it (default: RUN-epochN.pt here).",
            show_default=False,
        ),
    ] = None,
    url: UrlOption = DEFAULT_URL,
    token: TokenOption = None,
    as_json: JsonOption = False,
) -> None:
    """Download the run's newest checkpoint. Load it with
    `model.load_state_dict(torch.load(path)["model"])`."""
    token = require_token(token)
    with open_client(url) as client:
        found = client.download_checkpoint(token, run_id)
    if found is None:
        raise CommandError(f"run {run_id} has no checkpoint yet")
    data, epoch = found
    path = output if output is not None else Path(f"{run_id}-epoch{epoch}.pt")
    write_atomically(path, data)
    document = {
        "run_id": run_id,
        "epoch": epoch,
        "path": str(path),
        "size": len(data),
        "sha256": hashlib.sha256(data).hexdigest(),
    }
    emit(
        as_json,
        document,
        lambda console: console.print(
            f"Saved the checkpoint of epoch {epoch} ({len(data):,} bytes) to {path}",
            soft_wrap=True,
        ),
    )


@runs_app.command("checkpoints")
def checkpoints(
    run_id: RunArgument,
    pin: Annotated[
        int | None,
        typer.Option("--pin", help="Serve this epoch's checkpoint instead of the newest.", min=0),
    ] = None,
    unpin: Annotated[bool, typer.Option("--unpin", help="Serve the newest again.")] = False,
    delete: Annotated[
        int | None, typer.Option("--delete", help="Remove this epoch's checkpoint.", min=0)
    ] = None,
    url: UrlOption = DEFAULT_URL,
    token: TokenOption = None,
    as_json: JsonOption = False,
) -> None:
    """List the run's checkpoints, newest first (the served one is marked); --pin EPOCH,
    --unpin or --delete EPOCH first."""
    if sum((pin is not None, unpin, delete is not None)) > 1:
        raise UsageError("give at most one of --pin, --unpin and --delete")
    token = require_token(token)
    with open_client(url) as client:
        if pin is not None:
            client.pin_checkpoint(token, run_id, pin)
        elif unpin:
            client.unpin_checkpoint(token, run_id)
        elif delete is not None:
            client.delete_checkpoint(token, run_id, delete)
        found = client.list_checkpoints(token, run_id)
    served = next((c for c in found if c.pinned), found[0] if found else None)

    def render(console: Console) -> None:
        if not found:
            console.print(f"Run {run_id} has no checkpoint yet.")
            return
        for c in found:
            mark = ""
            if c is served:
                mark = "  (pinned, served)" if c.pinned else "  (served)"
            console.print(
                f"epoch {c.epoch}  {c.size:,} bytes  {c.created_at}  "
                f"peer {c.peer_id}  sha256 {c.sha256[:12]}{mark}",
                soft_wrap=True,
            )

    emit(as_json, {"run_id": run_id, "checkpoints": found}, render)


def write_atomically(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` through a temporary file in the same directory, so a reader
    never sees half a checkpoint."""
    directory = path.parent if str(path.parent) else Path(".")
    fd, temp = tempfile.mkstemp(prefix=f".{path.name}.", dir=directory)
    try:
        with os.fdopen(fd, "wb") as file:
            file.write(data)
            file.flush()
            os.fsync(file.fileno())
        os.replace(temp, path)
    except BaseException:
        Path(temp).unlink(missing_ok=True)
        raise
