"""Who may set a run's checkpoint: an upload is taken at an epoch the other volunteers have
reached, from the peer the run designates for that epoch, or once volunteers of two
invites agree on its digest.

* **Possible.** The epoch is at most the report guard's swarm epoch plus
  ``report_max_epoch_lead``; anything further is refused and logged.
* **Reached.** An upload more than one epoch past what the *other* volunteers reached
  (:func:`reached`: per invite the median, the run's figure the second highest invite's) is
  kept as a proposal (202): its digest only, never served.
* **Designated.** The uploader of an epoch is the lowest peer id among the online, unbanned
  peers at that epoch or the one before (the rule peers apply themselves).
* **Agreed.** Anyone else's upload is kept as a proposal; it is taken once a volunteer of a
  *different* invite uploads the same digest for the same epoch. One proposal per volunteer.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from sqlalchemy import delete, func, select
from sqlalchemy.orm import Session

from server.clock import now_ms
from server.exceptions import Conflict, InvalidContent
from server.models import Checkpoint, CheckpointProposal, Peer, ProgressReport, Volunteer
from server.services import presence

logger = logging.getLogger(__name__)

# A volunteer counts as having reached its reported epoch plus what it advanced over this many
# report intervals before its latest report (its next report is up to an interval away).
PACE_WINDOWS = 2


@dataclass(frozen=True, slots=True)
class Uploader:
    peer_id: str
    volunteer_id: int
    display_name: str
    designated: bool
    # The invite the volunteer came through (None: the organizer added it; it is its own).
    invite_id: str | None = None

    def named(self) -> str:
        return f"volunteer {self.volunteer_id} ({self.display_name!r}, peer {self.peer_id})"


def uploader(
    session: Session, run_id: str, peer_pk: int, epoch: int, *, online_ttl_s: float
) -> Uploader:
    """Who uploads, and whether the run designates it for ``epoch``; :class:`Conflict` when
    the run has a checkpoint of ``epoch`` or newer (checked before the body is read)."""
    latest = session.scalar(select(func.max(Checkpoint.epoch)).where(Checkpoint.run_id == run_id))
    if latest is not None and latest >= epoch:
        raise Conflict(
            f"run {run_id} already has a checkpoint of epoch {latest}; upload only newer epochs"
        )
    peer_id, volunteer_id, name, invite_id = session.execute(
        select(Peer.peer_id, Peer.volunteer_id, Volunteer.display_name, Volunteer.join_token_id)
        .join(Volunteer, Peer.volunteer_id == Volunteer.id)
        .where(Peer.id == peer_pk)
    ).one()
    since = now_ms() - int(online_ttl_s * 1000)
    lower = session.scalar(
        select(func.count())
        .select_from(Peer)
        .join(Volunteer, Peer.volunteer_id == Volunteer.id)
        .where(
            Peer.run_id == run_id,
            Peer.id != peer_pk,
            presence.online(since),
            Peer.last_report_ms.is_not(None),
            Peer.epoch >= epoch - 1,
            Peer.peer_id < peer_id,
            Volunteer.banned_at.is_(None),
        )
    )
    # Give the connection back to the pool while the body streams in.
    session.commit()
    return Uploader(
        str(peer_id),
        int(volunteer_id),
        str(name),
        designated=not lower,
        invite_id=None if invite_id is None else str(invite_id),
    )


@dataclass(frozen=True, slots=True)
class Progress:
    """One volunteer's epoch as the coordinator saw it: ``epoch`` in its latest report, and
    how far it advanced over the pace window before that."""

    volunteer_id: int
    epoch: int
    advanced: int
    # The invite the volunteer came through (None: the organizer added it).
    invite_id: str | None = None

    @property
    def reached(self) -> int:
        return self.epoch + max(0, self.advanced)

    @property
    def witness(self) -> str:
        """What counts once: its invite (a shared invite mints a volunteer per key)."""
        return f"volunteer {self.volunteer_id}" if self.invite_id is None else self.invite_id


def reached(progress: list[Progress], volunteer_id: int) -> int | None:
    """The epoch the volunteers other than ``volunteer_id`` have reached, None with none (a
    volunteer alone online is the swarm). Pure.

    Volunteers are cheap where invites are not: the others' :attr:`Progress.reached` count
    per invite as their upper median (the volunteers one invite minted must be mostly
    liars to move it), and the run's figure is the second highest of the invites' (the
    only one with a single invite): no one invite raises it alone."""
    by_invite: dict[str, list[int]] = {}
    for p in progress:
        if p.volunteer_id != volunteer_id:
            by_invite.setdefault(p.witness, []).append(p.reached)
    per_invite = sorted((sorted(v)[len(v) // 2] for v in by_invite.values()), reverse=True)
    return per_invite[min(1, len(per_invite) - 1)] if per_invite else None


def held_ahead(epoch: int, reached_epoch: int | None) -> bool:
    """Whether an upload of ``epoch`` is more than one epoch past ``reached_epoch`` (None:
    nobody else is online, and no upload is)."""
    return reached_epoch is not None and epoch > reached_epoch + 1


def progress(
    session: Session, run_id: str, *, online_ttl_s: float, window_s: float
) -> list[Progress]:
    """Each volunteer's :class:`Progress`, for the volunteers with a peer online that are
    not banned: their peers' highest reported epoch, and how far it rose over the
    ``window_s`` before their latest report (from the run's raw reports)."""
    now = now_ms()
    since = now - int(online_ttl_s * 1000)
    current: dict[int, tuple[int, str | None]] = {
        int(v): (int(e), None if invite is None else str(invite))
        for v, invite, e in session.execute(
            select(Peer.volunteer_id, Volunteer.join_token_id, func.max(Peer.epoch))
            .join(Volunteer, Peer.volunteer_id == Volunteer.id)
            .where(
                Peer.run_id == run_id,
                presence.online(since),
                Peer.last_report_ms.is_not(None),
                Volunteer.banned_at.is_(None),
            )
            .group_by(Peer.volunteer_id, Volunteer.join_token_id)
        )
    }
    window_start = now - int((window_s + online_ttl_s) * 1000)
    earliest: dict[int, int] = {
        int(v): int(e)
        for v, e in session.execute(
            select(Peer.volunteer_id, func.min(ProgressReport.epoch))
            .join(Peer, ProgressReport.peer_id == Peer.id)
            .where(
                ProgressReport.run_id == run_id,
                ProgressReport.reported_ms >= window_start,
                ProgressReport.reported_ms >= Peer.last_report_ms - int(window_s * 1000),
                Peer.volunteer_id.in_(list(current)),
            )
            .group_by(Peer.volunteer_id)
        )
    }
    return [Progress(v, e, e - earliest.get(v, e), invite) for v, (e, invite) in current.items()]


def refuse_unreached(
    run_id: str, who: Uploader, epoch: int, swarm_epoch: int | None, lead: int
) -> None:
    """:class:`InvalidContent` (logged, naming the volunteer) unless ``epoch`` is at most
    ``lead`` past ``swarm_epoch`` (None: the swarm's epoch is unknown, so nothing is)."""
    if swarm_epoch is not None and epoch <= swarm_epoch + lead:
        return
    known = "unknown" if swarm_epoch is None else str(swarm_epoch)
    logger.warning(
        "refused a checkpoint of epoch %d in run %s from %s: the swarm's epoch is %s",
        epoch,
        run_id,
        who.named(),
        known,
    )
    allowed = "" if swarm_epoch is None else f" (at most {swarm_epoch + lead} is accepted)"
    raise InvalidContent(
        f"epoch {epoch} is not one the swarm has reached: its epoch is {known}{allowed}"
    )


def propose(
    session: Session, run_id: str, who: Uploader, epoch: int, sha256: str, *, may_agree: bool
) -> bool:
    """Record ``who``'s digest for ``epoch``; True when ``may_agree`` and a volunteer of
    another invite proposed the same (the upload is then taken, and the epoch's proposals
    are spent)."""
    other_invite = (
        Volunteer.join_token_id.is_(None)
        if who.invite_id is None
        else Volunteer.join_token_id.is_(None) | (Volunteer.join_token_id != who.invite_id)
    )
    agreed = may_agree and session.scalar(
        select(func.count())
        .select_from(CheckpointProposal)
        .join(Volunteer, CheckpointProposal.volunteer_id == Volunteer.id)
        .where(
            CheckpointProposal.run_id == run_id,
            CheckpointProposal.epoch == epoch,
            CheckpointProposal.sha256 == sha256,
            CheckpointProposal.volunteer_id != who.volunteer_id,
            Volunteer.banned_at.is_(None),
            other_invite,
        )
    )
    session.execute(
        delete(CheckpointProposal).where(CheckpointProposal.volunteer_id == who.volunteer_id)
    )
    if agreed:
        session.execute(
            delete(CheckpointProposal).where(
                CheckpointProposal.run_id == run_id, CheckpointProposal.epoch <= epoch
            )
        )
        logger.info(
            "checkpoint of epoch %d in run %s: %s agrees with another volunteer's digest",
            epoch,
            run_id,
            who.named(),
        )
    else:
        session.add(
            CheckpointProposal(
                volunteer_id=who.volunteer_id,
                run_id=run_id,
                epoch=epoch,
                sha256=sha256,
                created_ms=now_ms(),
            )
        )
    session.commit()
    return bool(agreed)
