"""Creating, changing and archiving runs, and unlocking a run's signing authority; runs
that start when the swarm is there and finish at their last epoch.

* **Waiting.** A run with ``min_volunteers`` N is ``paused`` (its :func:`status_detail`
  says "waiting for N volunteers (k online)") until N distinct volunteers are online and
  have reported (:mod:`server.services.presence`); :func:`start_if_ready` starts it, checked
  at each join and each batch of reports. The organizer's resume starts it at once.
* **Finished at the last epoch.** A running run whose config names ``epochs`` finishes
  (:func:`finish_if_done`) once a checkpoint of that epoch is stored and the swarm reached
  it, as the checkpoint admission counts (:func:`swarm_epoch`: per invite the median, the
  run's figure the second highest invite's). Checked when a checkpoint is stored and when
  reports of that epoch are written.
"""

from __future__ import annotations

import dataclasses
import logging
import secrets
from collections.abc import Collection, Mapping

from sqlalchemy import func, select, update
from sqlalchemy.orm import Session

from peer.formats.identity import Identity
from peer.formats.open_types import ConfigValues
from server.clock import now_ms
from server.exceptions import Conflict, NotFound
from server.models import Checkpoint, Peer, Run, RunStatus, Volunteer, utcnow
from server.schemas import RunCreate, RunUpdate
from server.security import KeyBox
from server.services import checkpoint_admission as admission
from server.services import presence, task_files

logger = logging.getLogger(__name__)


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
    """A new run with a fresh Ed25519 signing authority: running, or with
    ``min_volunteers`` paused until that many volunteers are online."""
    run_id = secrets.token_hex(8)
    authority = Identity()
    now = utcnow()
    run = Run(
        id=run_id,
        name=data.name,
        task=data.task,
        config=data.config,
        status=RunStatus.running if data.min_volunteers is None else RunStatus.paused,
        min_volunteers=data.min_volunteers,
        created_at=now,
        updated_at=now,
        authority_public_key=authority.public_key,
        authority_private_key_encrypted=keybox.seal(authority.private_bytes(), run_id.encode()),
        last_snapshot_ms=0,
    )
    session.add(run)
    session.flush()
    if data.task_file is not None:
        task_files.attach(session, run, data.task_file)
    return run


def update_run(
    session: Session, run: Run, data: RunUpdate, *, online_ttl_s: float | None = None
) -> Run:
    """Apply a partial update. A finished or archived run can no longer change (finishing
    it again is harmless).

    A ``status`` is the organizer's hand: a run waiting for volunteers stops waiting.
    ``min_volunteers`` N holds the run (paused) until N volunteers are online — with
    ``online_ttl_s``, it starts at once if they are; null stops the wait and leaves the run
    paused. With both, the status applies first, then the hold (409 with ``finished``)."""
    if run.archived_at is not None:
        raise Conflict("run is archived and can no longer change")
    # Finishing a finished run changes nothing (it may have finished by itself).
    again = {"status"} if data.status is RunStatus.finished else set()
    if run.status is RunStatus.finished and data.model_fields_set - {"name", *again}:
        raise Conflict("run is finished; create a new run to train again")
    hold = "min_volunteers" in data.model_fields_set
    if hold and data.min_volunteers is not None and data.status is RunStatus.finished:
        raise Conflict("a finished run waits for nobody: leave min_volunteers out to finish it")
    if data.name is not None:
        run.name = data.name
    if data.config is not None:
        run.config = data.config
    if data.status is not None:
        run.status = data.status
        run.min_volunteers = None
    if hold:
        run.min_volunteers = data.min_volunteers
        if data.min_volunteers is not None:
            run.status = RunStatus.paused
    run.updated_at = utcnow()
    session.flush()
    if hold and online_ttl_s is not None:
        start_if_ready(session, run.id, online_ttl_s=online_ttl_s)
    return run


# ------------------------------------------------------------ starting and finishing


def volunteers_online(
    session: Session, run_ids: Collection[str], *, online_ttl_s: float, ready: bool = False
) -> dict[str, int]:
    """How many distinct volunteers, not banned, have a peer online in each of ``run_ids``
    (the runs without one are left out); ``ready``: a peer that has reported too (it has
    loaded its task and model and waits to train: a machine still loading is not there)."""
    if not run_ids:
        return {}
    since = now_ms() - int(online_ttl_s * 1000)
    where = [Peer.run_id.in_(list(run_ids)), presence.online(since), Volunteer.banned_at.is_(None)]
    if ready:
        where.append(Peer.last_report_ms.is_not(None))
    rows = session.execute(
        select(Peer.run_id, func.count(func.distinct(Peer.volunteer_id)))
        .join(Volunteer, Peer.volunteer_id == Volunteer.id)
        .where(*where)
        .group_by(Peer.run_id)
    )
    return {str(run_id): int(n) for run_id, n in rows}


def waiting(run: Run) -> bool:
    """The run is held until ``min_volunteers`` are online."""
    return run.min_volunteers is not None and run.status is RunStatus.paused


def status_detail(run: Run, online: int | None = None) -> str | None:
    """Why the run is in its status, for people (``online``: its volunteers online, for a
    waiting run); None for the organizer's own pause, resume or finish."""
    if waiting(run):
        wanted = run.min_volunteers
        text = f"waiting for {wanted} volunteer{'' if wanted == 1 else 's'}"
        return text if online is None else f"{text} ({online} online)"
    if run.status is RunStatus.finished and run.finished_at_epoch is not None:
        return f"reached its last epoch {run.finished_at_epoch}"
    return None


def start_if_ready(session: Session, run_id: str, *, online_ttl_s: float) -> bool:
    """Start the run if it waits for ``min_volunteers`` and that many are online; whether it
    started. One primary-key read for a run that does not wait."""
    wanted = session.scalar(
        select(Run.min_volunteers).where(
            Run.id == run_id, Run.status == RunStatus.paused, Run.archived_at.is_(None)
        )
    )
    if wanted is None:
        return False
    online = volunteers_online(session, [run_id], online_ttl_s=online_ttl_s, ready=True).get(
        run_id, 0
    )
    if online < wanted:
        return False
    # Conditional: an organizer who paused it, or asked for more, in the meantime wins.
    started = session.execute(
        update(Run)
        .where(
            Run.id == run_id,
            Run.status == RunStatus.paused,
            Run.min_volunteers.is_not(None),
            Run.min_volunteers <= online,
        )
        .values(status=RunStatus.running, min_volunteers=None, updated_at=utcnow())
    )
    # Session.execute is typed Result; an UPDATE's is a CursorResult, with rowcount.
    if started.rowcount != 1:  # type: ignore[attr-defined]
        return False
    logger.info("run %s started: %d volunteers online (it waited for %d)", run_id, online, wanted)
    return True


def last_epoch(config: ConfigValues | None) -> int | None:
    """The run's last epoch (its config's ``epochs``), None when it never ends by itself."""
    value = (config or {}).get("epochs")
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        return None
    return value


# Passed to admission.reached as the volunteer to leave out: none is.
_NOBODY = -1


def swarm_epoch(session: Session, run_id: str, *, online_ttl_s: float) -> int | None:
    """The epoch the run's volunteers online reported, as the checkpoint admission counts
    what the others reached, with nobody left out and nothing extrapolated: per invite the
    median, the run's figure the second highest invite's. None with nobody online."""
    progress = admission.progress(session, run_id, online_ttl_s=online_ttl_s, window_s=0.0)
    reported = [dataclasses.replace(p, advanced=0) for p in progress]
    return admission.reached(reported, _NOBODY)


def finish_if_done(session: Session, run_id: str, *, online_ttl_s: float) -> bool:
    """Finish the running run if it reached its last epoch: a checkpoint of that epoch is
    stored and :func:`swarm_epoch` is there. Whether it finished."""
    found = session.execute(
        select(Run.config).where(
            Run.id == run_id, Run.status == RunStatus.running, Run.archived_at.is_(None)
        )
    ).first()
    last = None if found is None else last_epoch(found[0])
    if last is None:
        return False
    saved = session.scalar(select(func.max(Checkpoint.epoch)).where(Checkpoint.run_id == run_id))
    if saved is None or saved < last:
        return False
    reached = swarm_epoch(session, run_id, online_ttl_s=online_ttl_s)
    if reached is None or reached < last:
        return False
    finished = session.execute(
        update(Run)
        .where(Run.id == run_id, Run.status == RunStatus.running, Run.archived_at.is_(None))
        .values(status=RunStatus.finished, finished_at_epoch=last, updated_at=utcnow())
    )
    # Session.execute is typed Result; an UPDATE's is a CursorResult, with rowcount.
    if finished.rowcount != 1:  # type: ignore[attr-defined]
        return False
    logger.info("run %s finished: it reached its last epoch %d", run_id, last)
    return True


def after_reports(session: Session, epochs: Mapping[str, int], *, online_ttl_s: float) -> None:
    """After a batch of reports is written (``epochs``: the highest epoch reported, per run):
    start the runs that waited for their volunteers, finish those at their last epoch. One
    query for runs that neither wait nor end."""
    if not epochs:
        return
    rows = session.execute(
        select(Run.id, Run.status, Run.min_volunteers, Run.config).where(
            Run.id.in_(list(epochs)), Run.archived_at.is_(None)
        )
    )
    for run_id, status, wanted, config in rows.all():
        if status is RunStatus.paused and wanted is not None:
            start_if_ready(session, run_id, online_ttl_s=online_ttl_s)
        elif status is RunStatus.running:
            last = last_epoch(config)
            if last is not None and epochs[run_id] >= last:
                finish_if_done(session, run_id, online_ttl_s=online_ttl_s)


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
