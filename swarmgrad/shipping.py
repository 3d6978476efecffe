"""The organizer's side of a task shipped with its run (``--task-file FILE[:function]`` and
``--requirement SPEC``, for ``swarmgrad runs create`` and ``swarmgrad demo``): read the file,
check it, load its task here, and make the ``task_file`` body the coordinator stores. The
volunteer's side is :mod:`peer.tasks.shipped`."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Annotated, Any

import typer

from peer.tasks.shipped import LocalTaskFile, parse_task_file, task_file_body

if TYPE_CHECKING:
    from peer.tasks.base import Task


TaskFileOption = Annotated[
    str | None,
    typer.Option(
        "--task-file",
        help="Ship this Python file with the run: FILE (its function task()) or "
        "FILE:function. Volunteers download it, check its SHA-256 and run it with their "
        "consent. Instead of --task.",
        show_default=False,
    ),
]
RequirementOption = Annotated[
    list[str] | None,
    typer.Option(
        "--requirement",
        help="A pip requirement of the --task-file (numpy>=1.26), installed by each "
        "volunteer into the task's own directory; repeat for more.",
        show_default=False,
    ),
]


@dataclass(frozen=True)
class TaskSource:
    """What a run trains: ``task`` (its name), and the file that ships it, if any."""

    task: str
    file: LocalTaskFile | None = None
    body: dict[str, Any] | None = None  # POST /runs' task_file

    def load(self) -> Task:
        """The task, loaded here as volunteers will: :class:`TaskError` when it cannot."""
        from peer.tasks.registry import load_task
        from peer.tasks.shipped import import_task_file

        if self.file is None:
            return load_task(self.task)
        return import_task_file(self.file.path, self.file.function)


def task_source(
    task: str | None, task_file: str | None, requirements: Sequence[str], *, default: str
) -> TaskSource:
    """``--task`` or ``--task-file`` (not both; ``default`` without either) with its
    ``--requirement`` options, checked: a usage error names the option at fault."""
    if task_file is None:
        if requirements:
            raise typer.BadParameter(
                "only a --task-file has requirements", param_hint="'--requirement'"
            )
        return TaskSource(task or default)
    if task is not None:
        raise typer.BadParameter("give --task or --task-file, not both", param_hint="'--task-file'")
    try:
        local = parse_task_file(task_file)
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="'--task-file'") from None
    try:
        body = task_file_body(local, requirements)
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="'--requirement'") from None
    return TaskSource(local.task, local, body)
