"""Joining a run, renewing certificates and handing out bootstrap peers."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

from sqlalchemy import func, select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from peer.identity import Certificate, peer_id_from_public_key
from server.clock import ms_to_datetime, now_ms
from server.exceptions import Conflict
from server.models import Peer, Run, RunStatus, Volunteer, utcnow
from server.schemas import JoinRequest, decode_public_key
from server.security import KeyBox
from server.services import runs as run_service
from server.services import tokens as token_service

DEFAULT_DISPLAY_NAME = "anonymous volunteer"


@dataclass(frozen=True, slots=True)
class Joined:
    peer: Peer
    peer_token: str
    certificate: Certificate
    certificate_expires_at: datetime
    bootstrap: list[Peer]


def ensure_accepting(run: Run, action: str) -> None:
    if run.archived_at is not None:
        raise Conflict(f"run {run.id} is archived; cannot {action}")
    if run.status is RunStatus.finished:
        raise Conflict(f"run {run.id} is finished; cannot {action}")
    if run.status is RunStatus.paused:
        raise Conflict(f"run {run.id} is paused; try again when the organizer resumes it")


def issue_certificate(
    keybox: KeyBox, run: Run, peer: Peer, ttl_s: float
) -> tuple[Certificate, datetime]:
    expires_ms = now_ms() + int(ttl_s * 1000)
    certificate = Certificate.issue(
        run_service.run_authority(keybox, run),
        run_id=run.id,
        public_key=peer.public_key,
        role="client" if peer.client_mode else "peer",
        expires_at=expires_ms / 1000,
    )
    return certificate, ms_to_datetime(expires_ms)


def join(
    session: Session,
    keybox: KeyBox,
    run: Run,
    join_token_id: str,
    data: JoinRequest,
    *,
    certificate_ttl_s: float,
    online_ttl_s: float,
    bootstrap_size: int,
) -> Joined:
    """Admit a peer: count a use of the join token, record (or refresh) the peer, rotate
    its peer token, sign its certificate and pick bootstrap peers for it.

    Joining again with the same public key updates the peer and revokes its old token.
    """
    ensure_accepting(run, "join")
    token_service.consume_join_token(session, join_token_id)
    public_key = decode_public_key(data.public_key)
    peer_id = peer_id_from_public_key(public_key)
    now = now_ms()
    peer = session.scalars(
        select(Peer).where(Peer.run_id == run.id, Peer.peer_id == peer_id)
    ).one_or_none()
    try:
        if peer is None:
            volunteer = Volunteer(
                run_id=run.id,
                display_name=data.display_name or DEFAULT_DISPLAY_NAME,
                join_token_id=join_token_id,
                created_at=utcnow(),
            )
            session.add(volunteer)
            session.flush()
            peer = Peer(
                run_id=run.id,
                peer_id=peer_id,
                public_key=public_key,
                volunteer_id=volunteer.id,
                addresses=list(data.addresses),
                client_mode=data.client_mode,
                first_seen_ms=now,
                last_seen_ms=now,
                epoch=0,
                samples=0,
                samples_base=0,
                samples_per_second=0.0,
            )
            session.add(peer)
            session.flush()
        else:
            peer.addresses = list(data.addresses)
            peer.client_mode = data.client_mode
            peer.last_seen_ms = max(peer.last_seen_ms, now)
            if data.display_name:
                peer.volunteer.display_name = data.display_name
            session.flush()
    except IntegrityError as exc:
        raise Conflict(
            "another join with this public key is in progress; retry in a moment"
        ) from exc
    peer_token = token_service.create_peer_token(session, run.id, peer.id)
    certificate, expires_at = issue_certificate(keybox, run, peer, certificate_ttl_s)
    bootstrap = sample_live_peers(
        session, run.id, exclude=peer.id, online_ttl_s=online_ttl_s, limit=bootstrap_size
    )
    return Joined(peer, peer_token, certificate, expires_at, bootstrap)


def touch(session: Session, peer_pk: int) -> None:
    """Record that a peer is alive."""
    now = now_ms()
    session.execute(
        update(Peer)
        .where(Peer.id == peer_pk, Peer.last_seen_ms < now)
        .values(last_seen_ms=now)
        .execution_options(synchronize_session=False)
    )


def sample_live_peers(
    session: Session, run_id: str, *, exclude: int, online_ttl_s: float, limit: int
) -> list[Peer]:
    """A uniform random sample of peers seen recently that accept connections."""
    since = now_ms() - int(online_ttl_s * 1000)
    query = (
        select(Peer)
        .where(
            Peer.run_id == run_id,
            Peer.id != exclude,
            Peer.last_seen_ms >= since,
            Peer.client_mode.is_(False),
        )
        .order_by(func.random())
        .limit(limit)
    )
    return [peer for peer in session.scalars(query) if peer.addresses]


def list_peers(session: Session, run_id: str) -> list[Peer]:
    return list(
        session.scalars(
            select(Peer).where(Peer.run_id == run_id).order_by(Peer.first_seen_ms, Peer.id)
        )
    )
