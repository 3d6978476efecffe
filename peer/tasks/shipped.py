"""Tasks shipped with their runs: one Python file (and pip requirements) that the organizer
attaches to a run, and that each volunteer downloads, checks, consents to and imports.

The organizer's side: :func:`parse_task_file` reads ``FILE[:function]`` (``task`` when not
named), :func:`task_file_body` is ``POST /runs``' ``task_file``, and :func:`import_task_file`
loads the task here, to check a run's config against it.

The volunteer's side is :func:`load_run_task`: download the file and check its SHA-256
against the run's and the one consented to; ask for (or find) the owner's :class:`Consent`;
``pip install --target`` its requirements into ``<data_dir>/tasks/<sha256>/site``, never the
volunteer's environment (staged, so a failure leaves nothing); import it with that directory
last on ``sys.path``. Each refusal is a :class:`TaskRefused` of one line, raised before
anything is imported or installed. The module is named as the file's stem; one of that name
already imported from elsewhere is refused, not replaced.
"""

from __future__ import annotations

import base64
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, TypedDict

from peer.formats.task_files import (
    MAX_TASK_FILE_BYTES,
    check_filename,
    check_requirement,
    sha256_hex,
    task_name,
)
from peer.tasks.base import TaskError
from peer.tasks.registry import load_task, task_from_module

if TYPE_CHECKING:
    from peer.coordinator.client import CoordinatorClient
    from peer.formats.payloads import TaskFilePublic
    from peer.tasks.base import Task

__all__ = [
    "Consent",
    "LocalTaskFile",
    "TaskRefused",
    "describe",
    "import_task_file",
    "install",
    "load_run_task",
    "parse_task_file",
    "task_file_body",
]

TASKS_DIR = "tasks"  # under the volunteer's data dir
_RECORD = "installed.json"  # written last: a task directory without it is incomplete


class TaskRefused(TaskError):
    """The volunteer will not run a shipped task: its bytes do not match the run's digest,
    its owner did not consent, or its requirements do not install. One line."""


# ------------------------------------------------------------------ the organizer's side


@dataclass(frozen=True)
class LocalTaskFile:
    """A task file on the organizer's machine: ``path`` and the ``function`` making the
    task."""

    path: Path
    function: str

    @property
    def task(self) -> str:
        """The run's task name: ``"my_task:make"``."""
        return task_name(self.path.name, self.function)


def parse_task_file(text: str) -> LocalTaskFile:
    """``"path/my_task.py[:make]"`` → the file and function (``task`` when not named);
    ``ValueError`` with one line when it is not a Python file of an importable name."""
    path_text, _, function = str(text).partition(":")
    path = Path(path_text).resolve()
    function = function or "task"
    if path.suffix != ".py" or not path.is_file():
        raise ValueError(f"{path_text}: not a Python file")
    try:
        check_filename(path.name)
        task_name(path.name, function)
    except ValueError:
        raise ValueError(
            f"{text}: the file's name and the function must be Python identifiers"
        ) from None
    size = path.stat().st_size
    if size > MAX_TASK_FILE_BYTES:
        raise ValueError(
            f"{path_text} is {size:,} bytes; a task file shipped with a run is at most "
            f"{MAX_TASK_FILE_BYTES:,} (put data and weights where the task downloads them)"
        )
    return LocalTaskFile(path, function)


def task_file_body(
    task_file: LocalTaskFile, requirements: Sequence[str] = ()
) -> dict[str, str | list[str]]:
    """The ``task_file`` of a run's creation: the file's name, bytes (base64) and
    ``requirements`` (each checked: ``ValueError`` naming a bad one)."""
    return {
        "filename": task_file.path.name,
        "content": base64.b64encode(task_file.path.read_bytes()).decode("ascii"),
        "requirements": [check_requirement(r) for r in requirements],
    }


def import_task_file(path: Path, function: str, *, site: Path | None = None) -> Task:
    """The task ``function()`` of the Python file at ``path`` returns, the module named as
    the file's stem; ``site`` (a directory of its requirements) is searched after
    everything else. :class:`TaskError` with one line for anything that fails."""
    name = task_name(path.name, function)
    module_name = path.stem
    if site is not None and str(site) not in sys.path:
        sys.path.append(str(site))
    module = sys.modules.get(module_name)
    if module is not None:
        if Path(getattr(module, "__file__", "") or "").resolve() != path.resolve():
            raise TaskError(
                f"cannot import task {name!r}: a module named {module_name!r} is already "
                "imported here from elsewhere; rename the task file"
            )
    else:
        spec = importlib.util.spec_from_file_location(module_name, path)
        if spec is None or spec.loader is None:
            raise TaskError(f"cannot import task {name!r}: {path} is not a Python module")
        module = importlib.util.module_from_spec(spec)
        sys.modules[module_name] = module  # as an import does: pickling, dataclasses
        try:
            spec.loader.exec_module(module)
        except Exception as exc:  # the organizer's code: any error means "cannot"
            del sys.modules[module_name]
            raise TaskError(f"cannot import task {name!r}: {_one_line(exc)}") from exc
    return task_from_module(name, module, function)


# ------------------------------------------------------------------ the volunteer's side


@dataclass(frozen=True)
class Consent:
    """How the volunteer's owner consents to running a run's task file: ``trusted`` (any
    file the run ships), ``sha256`` (only that file), or ``ask`` — shown a description
    (:func:`describe`), answers yes or no. None of them: refused."""

    trusted: bool = False
    sha256: str | None = None
    ask: Callable[[str], bool] | None = None


def describe(task: str, task_file: TaskFilePublic) -> str:
    """One line saying what a run ships: its task, file, digest, size and requirements."""
    requirements = ", ".join(task_file.requirements) or "none"
    return (
        f"task {task} from {task_file.filename} (sha256 {task_file.sha256}, "
        f"{task_file.size:,} bytes; requirements: {requirements})"
    )


def load_run_task(
    client: CoordinatorClient,
    token: str,
    run_id: str,
    data_dir: Path,
    consent: Consent,
    *,
    override: str | None = None,
) -> Task:
    """The task a volunteer trains in run ``run_id`` (``token``: its invite or peer token):
    ``override`` when given (``--task``), the run's shipped file when it ships one (see the
    module docstring), else the run's task installed here (:func:`load_task`)."""
    if override is not None:
        return load_task(override)
    run = client.run(run_id)
    if run.task_file is None:
        return load_task(run.task)
    shipped = run.task_file
    data = client.download_task(token, run_id)
    if len(data) > MAX_TASK_FILE_BYTES:
        raise TaskRefused(
            f"the task file {shipped.filename} from {client.host} is {len(data):,} bytes, over "
            f"the {MAX_TASK_FILE_BYTES:,} a run may ship: refused, nothing was installed or run"
        )
    digest = sha256_hex(data)
    if digest != shipped.sha256.lower():
        raise TaskRefused(
            f"the task file {shipped.filename} from {client.host} does not match the run's "
            f"digest (sha256 {digest}, the run names {shipped.sha256}): refused, nothing "
            "was installed or run"
        )
    _check_consent(describe(run.task, shipped), digest, consent)
    module, _, function = run.task.partition(":")
    filename = check_filename(f"{module}.py")
    requirements = [check_requirement(r) for r in shipped.requirements]
    directory = install(data_dir / TASKS_DIR, filename, data, requirements)
    site = directory / "site" if requirements else None
    return import_task_file(directory / filename, function, site=site)


def _check_consent(description: str, digest: str, consent: Consent) -> None:
    if consent.sha256 is not None:
        if consent.sha256.strip().lower() != digest:
            raise TaskRefused(
                f"the run ships {description}, not the file of sha256 {consent.sha256} "
                "you consented to: refused, nothing was installed or run"
            )
        return
    if consent.trusted:
        return
    if consent.ask is not None:
        if not consent.ask(description):
            raise TaskRefused("you declined to run the run's task file; nothing was installed")
        return
    raise TaskRefused(
        f"this run ships its {description}: code of the organizer's that runs with your "
        f"permissions; to run it, join again with --trust-task (or --task-sha256 {digest})"
    )


def install(root: Path, filename: str, data: bytes, requirements: Sequence[str]) -> Path:
    """The directory ``root/<sha256>`` holding the file ``filename`` with ``data`` and, in
    ``site``, its ``requirements`` installed by pip; reused when already complete for the
    same requirements. Built in a staging directory that replaces it only when complete:
    :class:`TaskRefused` (nothing left behind) when pip fails."""
    digest = sha256_hex(data)
    final = root / digest
    record: _Record = {"sha256": digest, "filename": filename, "requirements": list(requirements)}
    if _installed(final, filename, record):
        return final
    try:
        root.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f".{digest[:16]}-", dir=root))
    except OSError as exc:
        raise TaskRefused(f"cannot keep the run's task file in {root}: {exc.strerror}") from exc
    try:
        (staging / filename).write_bytes(data)
        if requirements:
            _pip_install(staging / "site", requirements)
        (staging / _RECORD).write_text(json.dumps(record))
        retired = None
        if final.exists():  # an incomplete one, or another run's requirements
            retired = Path(tempfile.mkdtemp(prefix=f".{digest[:16]}-old-", dir=root))
            final.rename(retired / "old")
        staging.rename(final)
        if retired is not None:
            shutil.rmtree(retired, ignore_errors=True)
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)
    return final


class _Record(TypedDict):
    """What :data:`_RECORD` holds: the file and requirements a task directory was built for."""

    sha256: str
    filename: str
    requirements: list[str]


def _installed(directory: Path, filename: str, record: _Record) -> bool:
    try:
        if json.loads((directory / _RECORD).read_text()) != record:
            return False
        return sha256_hex((directory / filename).read_bytes()) == record["sha256"]
    except (OSError, ValueError):
        return False


def _pip_install(target: Path, requirements: Sequence[str]) -> None:
    """``pip install --target target REQUIREMENTS`` with this Python's pip; the
    environment's pip settings apply (``PIP_INDEX_URL``, ``PIP_NO_INDEX``, ...), except
    that it never installs into the user's site-packages."""
    command = [
        sys.executable,
        "-m",
        "pip",
        "install",
        "--target",
        str(target),
        "--no-input",
        "--disable-pip-version-check",
        "--no-warn-script-location",
        "--quiet",
        "--",  # requirements, never options
        *requirements,
    ]
    env = {**os.environ, "PIP_USER": "0", "PIP_REQUIRE_VIRTUALENV": "0"}
    listed = ", ".join(requirements)
    try:
        done = subprocess.run(
            command, env=env, stdin=subprocess.DEVNULL, capture_output=True, text=True
        )
    except OSError as exc:
        raise TaskRefused(f"cannot run pip for the task's requirements: {exc.strerror}") from exc
    if done.returncode == 0:
        return
    lines = [x.strip() for x in (done.stderr + done.stdout).splitlines() if x.strip()]
    if any("No module named pip" in x for x in lines):
        why = f"this Python ({sys.executable}) has no pip"
    else:
        errors = [x.removeprefix("ERROR:").strip() for x in lines if x.startswith("ERROR:")]
        why = (errors or lines or [f"pip exited with status {done.returncode}"])[-1]
    raise TaskRefused(
        f"cannot install the task's requirements ({listed}): {why}; nothing was installed"
    )


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__
