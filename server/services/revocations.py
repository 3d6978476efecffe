"""A run's revocation list: the public keys of its banned volunteers' peers, signed by the
run's authority, so that peers can shut them out of the swarm themselves (their certificates
stay valid until they expire; see :mod:`peer.formats.revocation`).

The list's serial is the time of the run's newest ban in milliseconds, so it changes only
when someone is banned, and only upwards. Each entry lasts until the latest moment a
certificate issued before the ban can expire (its lifetime plus a minute of clock margin);
after that the entry is left out.
"""

from __future__ import annotations

from datetime import timedelta

from sqlalchemy import select
from sqlalchemy.orm import Session

from peer.formats.revocation import RevocationList
from server.models import Peer, Run, Volunteer, utcnow
from server.security import KeyBox
from server.services import runs as run_service

# Clock differences between the coordinator and the peers, on top of a certificate's life.
MARGIN = timedelta(minutes=1)


def serial(session: Session, run: Run) -> int:
    """The serial of the run's current list: its newest ban in ms (0 without bans)."""
    newest = session.scalars(
        select(Volunteer.banned_at)
        .where(Volunteer.run_id == run.id, Volunteer.banned_at.is_not(None))
        .order_by(Volunteer.banned_at.desc())
        .limit(1)
    ).first()
    return 0 if newest is None else int(newest.timestamp() * 1000)


def revocation_list(
    session: Session, keybox: KeyBox, run: Run, certificate_ttl_s: float
) -> RevocationList:
    """The run's current list, signed by its authority."""
    now = utcnow()
    life = timedelta(seconds=certificate_ttl_s) + MARGIN
    rows = session.execute(
        select(Peer.public_key, Volunteer.banned_at)
        .join(Volunteer, Peer.volunteer_id == Volunteer.id)
        .where(Peer.run_id == run.id, Volunteer.banned_at.is_not(None))
        .order_by(Peer.id)
    ).all()
    entries = []
    for key, banned_at in rows:
        assert banned_at is not None  # the query's condition
        if banned_at + life > now:
            entries.append((bytes(key), (banned_at + life).timestamp()))
    return RevocationList.issue(
        run_service.run_authority(keybox, run),
        run_id=run.id,
        serial=serial(session, run),
        entries=entries,
    )
