"""Who may set a run's checkpoint: an upload is taken at an epoch the swarm has reached, from
the peer the run designates for that epoch, or once two volunteers agree on its digest.

* **Reached.** The epoch may be no further past the swarm's epoch than a progress report of
  the uploader's volunteer could be: the report guard's own judgement
  (:meth:`server.services.report_guard.ReportGuard.swarm_epoch` plus
  ``report_max_epoch_lead``). A checkpoint "of epoch 2^53" is refused, and logged naming
  the volunteer, before its body is read.
* **Designated.** Peers pick the uploader of an epoch without a lock: the lowest peer id
  among the peers at that epoch or the one before (``peer.volunteer``). The coordinator
  applies the same rule to the peers it knows: online (seen within ``peer_online_ttl_s``),
  reported at that epoch or the one before, not banned. Its view of the epochs lags the
  gossip by a report or so, which only lets more uploaders through, never fewer.
* **Agreed.** An upload from anyone else is hashed and its digest kept as a proposal (the
  file is not): when a peer of a *different* volunteer uploads the same digest for the same
  epoch, that upload is taken. Two keys of one credential are one volunteer and never agree
  with each other. Each volunteer holds one proposal, its newest, so proposals take a row
  per volunteer at most.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from sqlalchemy import delete, func, select
from sqlalchemy.orm import Session

from server.clock import now_ms
from server.exceptions import Conflict, InvalidContent
from server.models import Checkpoint, CheckpointProposal, Peer, Volunteer
from server.services import presence

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Uploader:
    peer_id: str
    volunteer_id: int
    display_name: str
    designated: bool

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
    peer_id, volunteer_id, name = session.execute(
        select(Peer.peer_id, Peer.volunteer_id, Volunteer.display_name)
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
    return Uploader(str(peer_id), int(volunteer_id), str(name), designated=not lower)


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


def propose(session: Session, run_id: str, who: Uploader, epoch: int, sha256: str) -> bool:
    """Record ``who``'s digest for ``epoch``; True when another volunteer proposed the same
    (the upload is then taken, and the epoch's proposals are spent)."""
    agreed = session.scalar(
        select(func.count())
        .select_from(CheckpointProposal)
        .where(
            CheckpointProposal.run_id == run_id,
            CheckpointProposal.epoch == epoch,
            CheckpointProposal.sha256 == sha256,
            CheckpointProposal.volunteer_id != who.volunteer_id,
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
