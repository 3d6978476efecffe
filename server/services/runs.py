"""Creating, changing and archiving runs, and unlocking a run's signing authority."""

from __future__ import annotations

import secrets

from sqlalchemy import select
from sqlalchemy.orm import Session

from peer.formats.identity import Identity
from server.exceptions import Conflict, NotFound
from server.models import Run, RunStatus, utcnow
from server.schemas import RunCreate, RunUpdate
from server.security import KeyBox


def get_run(session: Session, run_id: str) -> Run:
    run = session.get(Run, run_id)
    if run is None:
        raise NotFound(f"no run with id {run_id!r}; list runs with GET /api/v1/runs")
    return run


def list_runs(session: Session, *, include_archived: bool = False) -> list[Run]:
    query = select(Run).order_by(Run.created_at.desc(), Run.id)
    if not include_archived:
        query = query.where(Run.archived_at.is_(None))
    return list(session.scalars(query))


def create_run(session: Session, keybox: KeyBox, data: RunCreate) -> Run:
    """A new running run with a fresh Ed25519 signing authority."""
    run_id = secrets.token_hex(8)
    authority = Identity()
    now = utcnow()
    run = Run(
        id=run_id,
        name=data.name,
        task=data.task,
        config=data.config,
        status=RunStatus.running,
        created_at=now,
        updated_at=now,
        authority_public_key=authority.public_key,
        authority_private_key_encrypted=keybox.seal(authority.private_bytes(), run_id.encode()),
        last_snapshot_ms=0,
    )
    session.add(run)
    session.flush()
    return run


def update_run(session: Session, run: Run, data: RunUpdate) -> Run:
    """Apply a partial update. A finished or archived run can no longer change."""
    if run.archived_at is not None:
        raise Conflict("run is archived and can no longer change")
    if run.status is RunStatus.finished and data.model_fields_set - {"name"}:
        raise Conflict("run is finished; create a new run to train again")
    if data.name is not None:
        run.name = data.name
    if data.config is not None:
        run.config = data.config
    if data.status is not None:
        run.status = data.status
    run.updated_at = utcnow()
    session.flush()
    return run


def archive_run(session: Session, run: Run) -> None:
    """Hide the run from listings and refuse new joins and reports; keep all its data."""
    if run.archived_at is None:
        now = utcnow()
        run.archived_at = now
        run.updated_at = now
        if run.status is not RunStatus.finished:
            run.status = RunStatus.finished
        session.flush()


def run_authority(keybox: KeyBox, run: Run) -> Identity:
    private = keybox.open(run.authority_private_key_encrypted, run.id.encode())
    return Identity.from_private_bytes(private)


def reseal_run_keys(session: Session, keybox: KeyBox) -> int:
    """Seal every run's signing key that still opens only under the previous server secret
    under the current one; how many were re-sealed. Idempotent. The caller commits, so all
    runs move together or none does: ``ValueError`` naming a run whose key opens under
    neither secret (nothing should then be committed)."""
    resealed = 0
    for run in session.scalars(select(Run).order_by(Run.id).with_for_update()):
        try:
            sealed = keybox.reseal(run.authority_private_key_encrypted, run.id.encode())
        except ValueError as exc:
            raise ValueError(f"run {run.id} ({run.name!r}): {exc}") from None
        if sealed is not None:
            run.authority_private_key_encrypted = sealed
            resealed += 1
    session.flush()
    return resealed
