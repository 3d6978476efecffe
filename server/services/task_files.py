"""Task files shipped with runs: stored once by the SHA-256 of their bytes (two runs of one
file share it), named by the runs that ship them, handed to the run's volunteers."""

from __future__ import annotations

from sqlalchemy.orm import Session

from peer.formats.task_files import sha256_hex
from server.exceptions import NotFound
from server.models import Run, TaskFile, utcnow
from server.schemas import TaskFileCreate, TaskFilePublic

__all__ = ["attach", "content", "public"]


def attach(session: Session, run: Run, upload: TaskFileCreate) -> None:
    """Store ``upload``'s bytes (unless a run already shipped the same) and make ``run``
    ship them with its requirements."""
    data = upload.data()
    digest = sha256_hex(data)
    if session.get(TaskFile, digest) is None:
        session.add(
            TaskFile(
                sha256=digest,
                filename=upload.filename,
                size=len(data),
                content=data,
                created_at=utcnow(),
            )
        )
        session.flush()
    run.task_sha256 = digest
    run.task_requirements = list(upload.requirements)


def public(session: Session, run: Run) -> TaskFilePublic | None:
    """What the run's public description says of its task file; None without one."""
    if run.task_sha256 is None:
        return None
    row = session.get(TaskFile, run.task_sha256)
    if row is None:  # the foreign key keeps it; a database edited by hand may not
        return None
    return TaskFilePublic(
        filename=f"{run.task.partition(':')[0]}.py",
        sha256=row.sha256,
        size=row.size,
        requirements=list(run.task_requirements or []),
    )


def content(session: Session, run: Run) -> tuple[bytes, str]:
    """The bytes of the file ``run`` ships and their SHA-256; :class:`NotFound` when it
    ships none (its volunteers have the task installed)."""
    row = None if run.task_sha256 is None else session.get(TaskFile, run.task_sha256)
    if row is None:
        raise NotFound(f"run {run.id} ships no task file: its task {run.task!r} is installed")
    return bytes(row.content), row.sha256
