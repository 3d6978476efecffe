"""Joining a run (with proof of holding the peer's key), renewing certificates and handing
out bootstrap peers.

A join's claimed ``addresses`` are never handed to other peers: bootstrap serves only the
address the reachability probe reached, made of the source address the coordinator saw
(``X-Forwarded-For`` only from a trusted proxy) and the port the peer named.

Joining is two calls. ``POST /join/challenge`` gives a short-lived challenge bound to the run
and the join token (see :class:`server.security.JoinChallenges`); the volunteer signs
``peer.formats.join_proof_payload(run_id, challenge, public_key)`` with its identity and
sends the signature with its public key to ``POST /runs/{run_id}/join``. Without the proof,
anyone holding an invite could register somebody else's public key (which every peer
announces) and take over that peer's row, token and addresses.
"""

from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass
from datetime import datetime

from sqlalchemy import case, func, select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from peer.formats.identity import (
    Certificate,
    join_proof_payload,
    peer_id_from_public_key,
    verify_signature,
)
from server.clock import ms_to_datetime, now_ms
from server.exceptions import Conflict, Forbidden, InvalidContent
from server.models import Peer, Run, RunStatus, Volunteer, utcnow
from server.schemas import JoinRequest, decode_public_key, decode_signature
from server.security import ChallengeRefused, JoinChallenge, JoinChallenges, KeyBox
from server.services import display_names, presence
from server.services import runs as run_service
from server.services import tokens as token_service
from server.services import volunteers as volunteer_service

DEFAULT_DISPLAY_NAME = "anonymous volunteer"
# Keys (machines) per volunteer credential, or per use of an invite, unless the run's config
# sets max_machines (peer.tasks.base.TrainingConfig).
DEFAULT_MAX_MACHINES = 8

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Joined:
    peer: Peer
    peer_token: str
    certificate: Certificate
    certificate_expires_at: datetime
    bootstrap: list[Peer]


def ensure_accepting(run: Run, action: str) -> None:
    """Refuse (409) once the run is finished or archived. A paused run still takes joins and
    renewals: its peers wait (they learn the status from the join answer and their polls)
    and start together when the organizer resumes it."""
    if run.archived_at is not None:
        raise Conflict(f"run {run.id} is archived; cannot {action}")
    if run.status is RunStatus.finished:
        raise Conflict(f"run {run.id} is finished; cannot {action}")


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
        volunteer=str(peer.volunteer_id),
        invite=invite_tag(run, peer.volunteer.join_token_id),
    )
    return certificate, ms_to_datetime(expires_ms)


def invite_tag(run: Run, join_token_id: str | None) -> str | None:
    """What a certificate names as the invite that admitted a volunteer: a digest of the
    invite's id (peers compare tags; the id itself stays with the coordinator). A shared
    invite admits a new volunteer per redemption, and peers counting witnesses count the
    volunteers of one invite as one."""
    if join_token_id is None:
        return None
    return hashlib.blake2b(f"{run.id}\0{join_token_id}".encode(), digest_size=12).hexdigest()


def max_machines(run: Run) -> int:
    """The run's ``max_machines`` (its config is checked by the volunteers' TrainingConfig;
    anything but a positive integer here means the default)."""
    value = (run.config or {}).get("max_machines", DEFAULT_MAX_MACHINES)
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        return DEFAULT_MAX_MACHINES
    return value


def ensure_machine_allowed(session: Session, run: Run, volunteer: Volunteer) -> None:
    """:class:`Forbidden` (logged, naming the volunteer) when ``volunteer`` already joined
    the run's ``max_machines`` keys; its row is locked first, so racing joins count right."""
    session.execute(select(Volunteer.id).where(Volunteer.id == volunteer.id).with_for_update())
    cap = max_machines(run)
    keys = session.scalar(select(func.count()).where(Peer.volunteer_id == volunteer.id)) or 0
    if keys < cap:
        return
    logger.warning(
        "refused a new key of volunteer %d (%r) in run %s: it joined %d machines already, "
        "the run's max_machines",
        volunteer.id,
        volunteer.display_name,
        run.id,
        keys,
    )
    raise Forbidden(
        f"this credential has joined {keys} machines, the most run {run.id} allows "
        "(max_machines); join again from one of them, or ask the organizer"
    )


def join_challenge(
    session: Session, challenges: JoinChallenges, run_id: str, join_token_id: str
) -> tuple[Run, JoinChallenge]:
    """A challenge for joining the join token's run; refused (409) while the run does not
    accept joins. A used-up token still gets one: its holder may join again with a key
    that already joined."""
    run = run_service.get_run(session, run_id)
    ensure_accepting(run, "join")
    return run, challenges.issue(run.id, join_token_id)


def check_join_proof(
    challenges: JoinChallenges, run_id: str, join_token_id: str, data: JoinRequest
) -> bytes:
    """The joiner's raw public key, once the challenge is genuine, unexpired and for this
    run and join token, and the signature is the key's own; :class:`Forbidden` otherwise."""
    hint = "; ask for a new one with POST /api/v1/join/challenge"
    try:
        challenges.check(data.challenge, run_id=run_id, token_id=join_token_id)
    except ChallengeRefused as exc:
        raise Forbidden(f"{exc}{hint}") from None
    public_key = decode_public_key(data.public_key)
    payload = join_proof_payload(run_id, data.challenge, public_key)
    if not verify_signature(public_key, decode_signature(data.signature), payload):
        raise Forbidden(
            "the signature does not prove possession of public_key's private key: sign "
            "peer.formats.join_proof_payload(run_id, challenge, public_key) with that key"
        )
    return public_key


def join(
    session: Session,
    keybox: KeyBox,
    challenges: JoinChallenges,
    run: Run,
    join_token_id: str,
    data: JoinRequest,
    *,
    certificate_ttl_s: float,
    peer_token_ttl_s: float,
    online_ttl_s: float,
    bootstrap_size: int,
) -> Joined:
    """Admit a peer that proved it holds its key (:func:`check_join_proof`, 403 otherwise):
    record (or refresh) the peer, rotate its peer token, sign its certificate and pick
    bootstrap peers for it.

    A new key counts one use of the join token (401 once it is used up). Joining again with
    a key that already joined uses nothing up (the token must still be unrevoked and
    unexpired); it updates the peer and revokes its old peer token. Nothing is written
    before the proof is checked.
    """
    ensure_accepting(run, "join")
    try:
        name = display_names.clean(data.display_name) if data.display_name else None
    except display_names.DisplayNameError as exc:
        raise InvalidContent(str(exc)) from None
    public_key = check_join_proof(challenges, run.id, join_token_id, data)
    peer_id = peer_id_from_public_key(public_key)
    now = now_ms()
    peer = session.scalars(
        select(Peer).where(Peer.run_id == run.id, Peer.peer_id == peer_id)
    ).one_or_none()
    personal = volunteer_service.personal_volunteer(session, join_token_id)
    if peer is not None:
        volunteer_service.ensure_not_banned(peer.volunteer)
    if personal is None and name and name != DEFAULT_DISPLAY_NAME:
        # A name is one volunteer's: a new volunteer, or a rename, may not take another's
        # (nor one that reads the same).
        try:
            volunteer_service.ensure_name_free(
                session,
                run.id,
                name,
                exclude=None if peer is None else peer.volunteer_id,
            )
        except volunteer_service.NameTaken as exc:
            raise Conflict(str(exc)) from None
    if peer is None:
        token_service.consume_join_token(session, join_token_id)
    else:
        token_service.ensure_join_token_valid(session, join_token_id)
    try:
        if peer is None:
            volunteer = personal
            if volunteer is not None:
                ensure_machine_allowed(session, run, volunteer)
            if volunteer is None:
                volunteer = Volunteer(
                    run_id=run.id,
                    display_name=name or DEFAULT_DISPLAY_NAME,
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
                # What a joiner claims is never handed to others: only the address the
                # reachability probe reached (server.services.reachability).
                addresses=[],
                client_mode=data.client_mode,
                first_seen_ms=now,
                last_seen_ms=now,
                session_started_ms=now,
                online_ms=0,
                epoch=0,
                samples=0,
                samples_base=0,
                samples_per_second=0.0,
            )
            session.add(peer)
            session.flush()
        else:
            if data.client_mode:  # a probed address stays until the next probe
                peer.addresses = []
            peer.client_mode = data.client_mode
            if peer.last_seen_ms < now - int(online_ttl_s * 1000):  # back after a gap
                if peer.session_started_ms is not None:
                    peer.online_ms += peer.last_seen_ms - peer.session_started_ms
                peer.session_started_ms = now
            peer.last_seen_ms = max(peer.last_seen_ms, now)
            if personal is not None and peer.volunteer_id != personal.id:
                raise Conflict("this key already joined the run as another volunteer")
            if name and personal is None:
                peer.volunteer.display_name = name
            session.flush()
    except IntegrityError as exc:
        raise Conflict(
            "another join with this public key is in progress; retry in a moment"
        ) from exc
    peer_token = token_service.create_peer_token(session, run.id, peer.id, peer_token_ttl_s)
    certificate, expires_at = issue_certificate(keybox, run, peer, certificate_ttl_s)
    bootstrap = sample_live_peers(
        session, run.id, exclude=peer.id, online_ttl_s=online_ttl_s, limit=bootstrap_size
    )
    # A run waiting for its volunteers may start with this one (its answer says so).
    run_service.start_if_ready(session, run.id, online_ttl_s=online_ttl_s)
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


def leave(session: Session, peer_pk: int) -> None:
    """Record that a peer said it leaves: it counts as offline until heard from again
    (server.services.presence). ``last_seen_ms`` stays its last contact; idempotent."""
    now = now_ms()
    session.execute(
        update(Peer)
        .where(Peer.id == peer_pk)
        # Never before its last contact: a leave always hides what came before it.
        .values(left_ms=case((Peer.last_seen_ms > now, Peer.last_seen_ms), else_=now))
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
            presence.online(since),
            Peer.client_mode.is_(False),
        )
        .order_by(func.random())
        .limit(limit)
    )
    # a peer behind a NAT (a punch:// address) is met through the rendezvous, not dialed
    return [
        peer
        for peer in session.scalars(query)
        if any(not address.startswith("punch://") for address in peer.addresses)
    ]


def list_peers(session: Session, run_id: str) -> list[Peer]:
    return list(
        session.scalars(
            select(Peer).where(Peer.run_id == run_id).order_by(Peer.first_seen_ms, Peer.id)
        )
    )
