"""Checkpoints peers upload, so that a volunteer who joins later starts from the run's
newest weights rather than from scratch, and the organizer can download the model.

A checkpoint is what ``torch.save`` writes (a zip archive); the coordinator checks the zip
signature and hashes it, never unpickles it. An upload is streamed to a temporary file,
fsynced and renamed into place before its row is inserted. The newest ``checkpoint_keep``
per run are kept, and the pinned one, which is served instead of the newest while pinned.
Who may upload which epoch: :mod:`server.services.checkpoint_admission`.

With ``checkpoint_dir_max_bytes`` all runs' checkpoints together stay under that bound: the
oldest are removed first but never a run's newest; an upload alone over it is refused (413),
one that cannot fit beside the runs' newest is refused (507). Files live in the shared
``checkpoint_dir``; the rows decide, under a lock on the run's row (or
:data:`DIRECTORY_LOCK` under the bound), so of two concurrent uploads the older is refused.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import os
import secrets
import tempfile
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

from sqlalchemy import delete, func, select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from server.exceptions import (
    Conflict,
    InsufficientStorage,
    InvalidContent,
    NotFound,
    PayloadTooLarge,
)
from server.models import Checkpoint, Housekeeping, Run, utcnow
from server.schemas import CheckpointPublic
from server.services import checkpoint_admission as admission
from server.services.report_guard import ReportGuard

logger = logging.getLogger(__name__)

ZIP_MAGIC = b"PK\x03\x04"
# Received chunks are gathered into blocks of this size before a thread writes them.
_BLOCK_BYTES = 1024 * 1024
# The housekeeping row that uploads lock while they make room under the directory bound.
DIRECTORY_LOCK = "checkpoint_directory"


@dataclass(frozen=True, slots=True)
class CheckpointStore:
    """Where the files are, and the limits (from the settings)."""

    directory: Path
    keep: int
    max_bytes: int
    # All runs' checkpoints together (None: no bound).
    dir_max_bytes: int | None = None

    @property
    def upload_limit(self) -> int:
        """The largest upload accepted."""
        if self.dir_max_bytes is None:
            return self.max_bytes
        return min(self.max_bytes, self.dir_max_bytes)

    def run_directory(self, run_id: str) -> Path:
        return self.directory / run_id

    def path(self, checkpoint: Checkpoint) -> Path:
        return self.run_directory(checkpoint.run_id) / checkpoint.filename


@dataclass(frozen=True, slots=True)
class Uploaded:
    """An upload's outcome: the checkpoint taken, or None when only its digest was kept as
    a proposal (``detail`` says so)."""

    checkpoint: Checkpoint | None
    detail: str


@dataclass(frozen=True, slots=True)
class _Stored:
    path: Path
    size: int
    sha256: str


def public(checkpoint: Checkpoint) -> CheckpointPublic:
    return CheckpointPublic(
        epoch=checkpoint.epoch,
        size=checkpoint.size,
        sha256=checkpoint.sha256,
        created_at=checkpoint.created_at,
        peer_id=checkpoint.peer_id,
        pinned=checkpoint.pinned_at is not None,
    )


def served(session: Session, run_id: str) -> Checkpoint | None:
    """The checkpoint downloads and newcomers get: the pinned one, else the newest."""
    return session.scalars(
        select(Checkpoint)
        .where(Checkpoint.run_id == run_id)
        .order_by(Checkpoint.pinned_at.is_(None), Checkpoint.epoch.desc())
        .limit(1)
    ).first()


def get_checkpoint(session: Session, run_id: str, epoch: int) -> Checkpoint:
    checkpoint = session.scalars(
        select(Checkpoint).where(Checkpoint.run_id == run_id, Checkpoint.epoch == epoch)
    ).first()
    if checkpoint is None:
        raise NotFound(f"run {run_id} has no checkpoint of epoch {epoch}")
    return checkpoint


def pin(session: Session, run_id: str, epoch: int) -> Checkpoint:
    """Serve the checkpoint of ``epoch`` (and keep it) until unpinned; any other pin of the
    run is dropped. The caller commits."""
    checkpoint = get_checkpoint(session, run_id, epoch)
    session.execute(select(Run.id).where(Run.id == run_id).with_for_update())
    for other in session.scalars(
        select(Checkpoint).where(Checkpoint.run_id == run_id, Checkpoint.pinned_at.is_not(None))
    ):
        if other.id != checkpoint.id:
            other.pinned_at = None
    if checkpoint.pinned_at is None:
        checkpoint.pinned_at = utcnow()
    session.flush()
    return checkpoint


def unpin(session: Session, run_id: str) -> None:
    """Serve the newest checkpoint again. The caller commits."""
    for checkpoint in session.scalars(
        select(Checkpoint).where(Checkpoint.run_id == run_id, Checkpoint.pinned_at.is_not(None))
    ):
        checkpoint.pinned_at = None
    session.flush()


def delete_checkpoint(session: Session, store: CheckpointStore, run_id: str, epoch: int) -> None:
    """Remove the checkpoint of ``epoch``, row and file (committed here); uploads of epochs
    up to the next newest are taken again."""
    checkpoint = get_checkpoint(session, run_id, epoch)
    path = store.path(checkpoint)
    session.delete(checkpoint)
    session.commit()
    _discard(path)


def list_checkpoints(session: Session, run_id: str) -> list[Checkpoint]:
    """The run's checkpoints, newest first."""
    return list(
        session.scalars(
            select(Checkpoint).where(Checkpoint.run_id == run_id).order_by(Checkpoint.epoch.desc())
        )
    )


def served_file(session: Session, store: CheckpointStore, run_id: str) -> tuple[Checkpoint, Path]:
    """The served checkpoint (:func:`served`) and its file; :class:`NotFound` when there is
    none."""
    checkpoint = served(session, run_id)
    if checkpoint is None:
        raise NotFound(f"run {run_id} has no checkpoint yet; peers upload one as they train")
    path = store.path(checkpoint)
    if not path.is_file():
        raise NotFound(
            f"the file of run {run_id}'s checkpoint of epoch {checkpoint.epoch} is missing "
            "on the coordinator; the next upload replaces it"
        )
    return checkpoint, path


async def upload(
    session: Session,
    store: CheckpointStore,
    run: Run,
    peer_pk: int,
    epoch: int,
    body: AsyncIterator[bytes],
    content_length: int | None,
    *,
    guard: ReportGuard,
    online_ttl_s: float,
    report_interval_s: float,
) -> Uploaded:
    """Store the checkpoint of ``epoch`` streamed in ``body`` if the run takes it from this
    peer at this epoch (:mod:`~server.services.checkpoint_admission`; otherwise only its
    digest is kept, as a proposal: held when the epoch is more than one past what the other
    volunteers reached), and keep the newest ``store.keep`` (and the directory under
    ``store.dir_max_bytes``): 409 when the run has one of the same or a newer epoch (checked
    before and after receiving), 413 over ``store.upload_limit``, 422 for an epoch the swarm
    has not reached or a body that is not a zip archive, 507 when the disk refuses the file
    or the directory bound has no room for it. Nothing is left behind on failure, and
    nothing stored is removed."""
    if run.archived_at is not None:
        raise Conflict(f"run {run.id} is archived; it takes no more checkpoints")
    if content_length is not None and content_length > store.upload_limit:
        raise _too_large(store)
    who = await asyncio.to_thread(
        admission.uploader, session, run.id, peer_pk, epoch, online_ttl_s=online_ttl_s
    )
    lead = guard.limits.max_epoch_lead
    swarm = await guard.swarm_epoch(run.id, who.volunteer_id, at_least=epoch - lead)
    admission.refuse_unreached(run.id, who, epoch, swarm, lead)
    progress = await asyncio.to_thread(
        admission.progress,
        session,
        run.id,
        online_ttl_s=online_ttl_s,
        window_s=admission.PACE_WINDOWS * report_interval_s,
    )
    reached = admission.reached(progress, who.volunteer_id)
    ahead = admission.held_ahead(epoch, reached)
    stored = await _receive(store, run.id, epoch, body)
    try:
        if (ahead or not who.designated) and not await asyncio.to_thread(
            admission.propose, session, run.id, who, epoch, stored.sha256, may_agree=not ahead
        ):
            _discard(stored.path)
            return Uploaded(None, _held_detail(run.id, who, epoch, reached, ahead=ahead))
        checkpoint, pruned = await asyncio.to_thread(
            _record, session, store, run.id, epoch, who.peer_id, stored
        )
    except BaseException:
        _discard(stored.path)
        raise
    _discard(*pruned)
    return Uploaded(checkpoint, f"checkpoint of epoch {epoch} stored")


def _held_detail(
    run_id: str, who: admission.Uploader, epoch: int, reached: int | None, *, ahead: bool
) -> str:
    if not ahead:
        return (
            "another peer is this epoch's uploader; the digest is kept, and the checkpoint "
            f"of epoch {epoch} is taken once a volunteer of another invite uploads it"
        )
    logger.warning(
        "held a checkpoint of epoch %d in run %s from %s: the other volunteers reached %s",
        epoch,
        run_id,
        who.named(),
        "no epoch" if reached is None else f"epoch {reached}",
    )
    return (
        f"epoch {epoch} is more than one past what the other volunteers reached "
        f"({'none' if reached is None else reached}); the digest is kept, and nothing is "
        "served from it"
    )


def _too_large(store: CheckpointStore) -> PayloadTooLarge:
    if store.upload_limit < store.max_bytes:
        return PayloadTooLarge(
            f"checkpoint over the {store.upload_limit} bytes the coordinator keeps for all "
            "runs' checkpoints together (SWARMGRAD_CHECKPOINT_DIR_MAX_BYTES); ask the "
            "organizer to raise it"
        )
    return PayloadTooLarge(
        f"checkpoint over the coordinator's limit of {store.max_bytes} bytes "
        "(SWARMGRAD_CHECKPOINT_MAX_BYTES); ask the organizer to raise it"
    )


def _create_temporary(directory: Path) -> tuple[int, str]:
    directory.mkdir(parents=True, exist_ok=True)
    return tempfile.mkstemp(prefix=".upload-", suffix=".tmp", dir=directory)


def _discard(*paths: Path) -> None:
    """Delete files that may or may not exist (an unlink does not block for long)."""
    for path in paths:
        with contextlib.suppress(OSError):
            path.unlink(missing_ok=True)


def _write_block(file: int, block: bytes) -> None:
    view = memoryview(block)
    while view:
        written = os.write(file, view)
        view = view[written:]


def _finish(file: int, temporary: Path, final: Path) -> None:
    try:
        os.fsync(file)
    finally:
        os.close(file)
    os.replace(temporary, final)
    # The rename itself is durable only once the directory is.
    directory = os.open(final.parent, os.O_RDONLY)
    try:
        os.fsync(directory)
    finally:
        os.close(directory)


async def _receive(
    store: CheckpointStore, run_id: str, epoch: int, body: AsyncIterator[bytes]
) -> _Stored:
    directory = store.run_directory(run_id)
    try:
        file, name = await asyncio.to_thread(_create_temporary, directory)
    except OSError as exc:
        raise _storage_error(exc) from exc
    temporary = Path(name)
    final = directory / f"epoch-{epoch:012d}-{secrets.token_hex(4)}.pt"
    digest = hashlib.sha256()
    size = 0
    head = b""
    block: list[bytes] = []
    block_size = 0

    def write(data: bytes) -> None:
        digest.update(data)
        _write_block(file, data)

    open_file = True
    try:
        async for chunk in body:
            if not chunk:
                continue
            size += len(chunk)
            if size > store.upload_limit:
                raise _too_large(store)
            if len(head) < len(ZIP_MAGIC):
                head += chunk[: len(ZIP_MAGIC) - len(head)]
                if not ZIP_MAGIC.startswith(head):
                    raise _not_a_zip()
            block.append(chunk)
            block_size += len(chunk)
            if block_size >= _BLOCK_BYTES:
                await asyncio.to_thread(write, b"".join(block))
                block, block_size = [], 0
        if head != ZIP_MAGIC:
            raise _not_a_zip()
        if block:
            await asyncio.to_thread(write, b"".join(block))
        open_file = False
        await asyncio.to_thread(_finish, file, temporary, final)
    except BaseException as exc:
        if open_file:
            with contextlib.suppress(OSError):
                os.close(file)
        _discard(temporary, final)
        if isinstance(exc, OSError):
            raise _storage_error(exc) from exc
        raise
    return _Stored(final, size, digest.hexdigest())


def _not_a_zip() -> InvalidContent:
    return InvalidContent(
        "a checkpoint is the zip archive torch.save writes (it starts with PK\\x03\\x04); "
        "send the file's bytes as application/octet-stream"
    )


def _storage_error(exc: OSError) -> InsufficientStorage:
    reason = exc.strerror or type(exc).__name__
    return InsufficientStorage(
        f"the coordinator could not store the checkpoint ({reason}); try again later, or ask "
        "the organizer to free disk space"
    )


def _record(
    session: Session,
    store: CheckpointStore,
    run_id: str,
    epoch: int,
    peer_id: str,
    stored: _Stored,
) -> tuple[Checkpoint, list[Path]]:
    """Insert the row and drop the rows beyond ``store.keep`` and the directory bound;
    returns the files to delete once committed."""
    # Serialise uploads of one run: the row lock (PostgreSQL; SQLite omits FOR UPDATE) and,
    # on SQLite, the write lock the INSERT takes are held until the commit, so the check for
    # a newer epoch below sees every other upload.
    session.execute(select(Run.id).where(Run.id == run_id).with_for_update())
    checkpoint = Checkpoint(
        run_id=run_id,
        epoch=epoch,
        size=stored.size,
        sha256=stored.sha256,
        filename=stored.path.name,
        peer_id=peer_id,
        created_at=utcnow(),
    )
    session.add(checkpoint)
    try:
        session.flush()
    except IntegrityError:
        session.rollback()
        raise Conflict(
            f"run {run_id} already has a checkpoint of epoch {epoch}; upload only newer epochs"
        ) from None
    newer = session.scalar(
        select(func.max(Checkpoint.epoch)).where(
            Checkpoint.run_id == run_id, Checkpoint.epoch > epoch
        )
    )
    if newer is not None:
        session.rollback()
        raise Conflict(
            f"run {run_id} already has a checkpoint of epoch {newer}; upload only newer epochs"
        )
    old = [
        c
        for c in session.scalars(
            select(Checkpoint)
            .where(Checkpoint.run_id == run_id)
            .order_by(Checkpoint.epoch.desc())
            .offset(store.keep)
        )
        if c.pinned_at is None
    ]
    if store.dir_max_bytes is not None:
        old += _over_bound(session, store.dir_max_bytes, {c.id for c in old})
    pruned = [store.path(c) for c in old]
    if old:
        session.execute(delete(Checkpoint).where(Checkpoint.id.in_([c.id for c in old])))
    session.commit()
    return checkpoint, pruned


def _over_bound(session: Session, bound: int, dropped: set[int]) -> list[Checkpoint]:
    """The checkpoints to remove, oldest first and never a run's newest or pinned, for the rest
    (besides ``dropped``) to fit in ``bound`` bytes; :class:`InsufficientStorage` (nothing
    removed) when they cannot."""
    # Other runs' uploads commit one at a time (SQLite's write lock already does this).
    session.execute(
        select(Housekeeping.name).where(Housekeeping.name == DIRECTORY_LOCK).with_for_update()
    )
    kept = [
        c
        for c in session.scalars(select(Checkpoint).order_by(Checkpoint.created_at, Checkpoint.id))
        if c.id not in dropped
    ]
    total = sum(c.size for c in kept)
    newest_epoch: dict[str, int] = {}
    for c in kept:
        newest_epoch[c.run_id] = max(c.epoch, newest_epoch.get(c.run_id, c.epoch))
    removed = []
    for c in kept:
        if total <= bound:
            break
        if c.epoch != newest_epoch[c.run_id] and c.pinned_at is None:
            removed.append(c)
            total -= c.size
    if total > bound:
        session.rollback()
        runs = len(newest_epoch)
        raise InsufficientStorage(
            f"no room for this checkpoint under the coordinator's bound of {bound} bytes "
            f"for all checkpoints (SWARMGRAD_CHECKPOINT_DIR_MAX_BYTES): the newest "
            f"checkpoints of {runs} runs take {total} bytes with it, and a run's newest is "
            "never removed; ask the organizer to raise the bound or delete finished runs"
        )
    return removed
