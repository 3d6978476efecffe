"""Peer endpoints: a join challenge and the join with a join token; then reachability,
bootstrap, certificate renewal and reports with the peer token issued at join."""

from __future__ import annotations

from fastapi import APIRouter, Request, Response, status

from server.api import API_PREFIX
from server.api.deps import (
    CurrentInvitee,
    CurrentJoiner,
    CurrentOrganizer,
    CurrentPeer,
    JoinChallengesDep,
    KeyBoxDep,
    ReportBufferDep,
    ReportGuardDep,
    ReportingPeer,
    RunDep,
    SessionDep,
    SettingsDep,
)
from server.clock import ms_to_datetime, now_ms
from server.models import Peer
from server.schemas import (
    BootstrapPeer,
    BootstrapPublic,
    CertificatePublic,
    ErrorPublic,
    JoinChallengePublic,
    JoinRequest,
    JoinResponse,
    PeerPublic,
    PeersPublic,
    ReachabilityPublic,
    ReachabilityRequest,
    RendezvousPeer,
    RendezvousPublic,
    ReportAccepted,
    ReportCreate,
    encode_bytes,
)
from server.services import checkpoints as checkpoint_service
from server.services import peers as peer_service
from server.services import presence
from server.services import reachability as reachability_service
from server.services import tokens as token_service
from server.services import volunteers as volunteer_service
from server.services.report_guard import take_report

router = APIRouter(prefix=f"{API_PREFIX}/runs/{{run_id}}", tags=["peers"])
join_router = APIRouter(prefix=f"{API_PREFIX}/join", tags=["peers"])
# Its own router so that the app can match it before every other route.
reports_router = APIRouter(prefix=f"{API_PREFIX}/runs/{{run_id}}", tags=["peers"])
_ACCEPTED = ReportAccepted().model_dump_json().encode()
# Answered by server.api.rate_limits before the route, when a limit is reached.
_RATE_LIMITED: dict[int | str, dict[str, object]] = {
    429: {"model": ErrorPublic, "description": "Over a rate limit; Retry-After says when to retry."}
}


def bootstrap_peer(peer: Peer) -> BootstrapPeer:
    return BootstrapPeer(peer_id=peer.peer_id, addresses=list(peer.addresses))


@router.get("/peers", response_model=PeersPublic)
def list_peers(
    _: CurrentOrganizer, session: SessionDep, settings: SettingsDep, run: RunDep
) -> PeersPublic:
    """Every peer that joined the run, oldest first, with its volunteer's display name and
    latest report."""
    online_since = now_ms() - int(settings.peer_online_ttl_s * 1000)
    return PeersPublic(
        peers=[
            PeerPublic(
                peer_id=p.peer_id,
                display_name=p.volunteer.display_name,
                addresses=list(p.addresses),
                client_mode=p.client_mode,
                online=presence.is_online(p, online_since),
                first_seen_at=ms_to_datetime(p.first_seen_ms),
                last_seen_at=ms_to_datetime(p.last_seen_ms),
                last_report_at=None
                if p.last_report_ms is None
                else ms_to_datetime(p.last_report_ms),
                epoch=p.epoch,
                samples=p.samples_base + p.samples,
                samples_per_second=p.samples_per_second,
                loss=p.loss,
                eval_metric=p.eval_metric,
                reports_refused=p.reports_refused,
                last_refusal=p.last_refusal,
                last_refusal_at=None
                if p.last_refusal_ms is None
                else ms_to_datetime(p.last_refusal_ms),
            )
            for p in peer_service.list_peers(session, run.id)
        ]
    )


@join_router.post("/challenge", response_model=JoinChallengePublic, responses=_RATE_LIMITED)
def join_challenge(
    invitee: CurrentInvitee, session: SessionDep, challenges: JoinChallengesDep
) -> JoinChallengePublic:
    """A challenge for joining the join token's run, valid for ``join_challenge_ttl_s``.
    Next: sign ``peer.formats.identity.join_proof_payload(run_id, challenge, public_key)`` with the
    peer's identity and ``POST /runs/{run_id}/join``. Refused (409) once the run is finished
    or archived; a paused run admits peers, which wait until it resumes."""
    assert invitee.run_id is not None  # join tokens belong to a run
    run, challenge = peer_service.join_challenge(
        session, challenges, invitee.run_id, invitee.token_id
    )
    return JoinChallengePublic(
        run_id=run.id,
        run_name=run.name,
        task=run.task,
        status=run.status,
        challenge=challenge.text,
        expires_at=ms_to_datetime(challenge.expires_ms),
    )


@router.post("/join", response_model=JoinResponse, responses=_RATE_LIMITED)
def join_run(
    joiner: CurrentJoiner,
    session: SessionDep,
    settings: SettingsDep,
    keybox: KeyBoxDep,
    challenges: JoinChallengesDep,
    run: RunDep,
    body: JoinRequest,
) -> JoinResponse:
    """Trade a join token, and proof of holding the peer's key, for a peer token and a run
    certificate. 403 for a challenge that is not genuine, expired or for another run or
    invite, or a signature not made by ``public_key``'s private key; 409 while the run is
    paused, finished or archived. Next: check reachability (``POST /runs/{run_id}/
    reachability``), then start a ``peer.Node`` with ``CertificateAuth(certificate,
    CertificateVerifier(run_public_key, run_id))`` and the bootstrap peers as initial peers,
    from the checkpoint if there is one."""
    joined = peer_service.join(
        session,
        keybox,
        challenges,
        run,
        joiner.token_id,
        body,
        certificate_ttl_s=settings.certificate_ttl_s,
        peer_token_ttl_s=settings.peer_token_ttl_s,
        online_ttl_s=settings.peer_online_ttl_s,
        bootstrap_size=settings.bootstrap_peers,
    )
    checkpoint = checkpoint_service.served(session, run.id)
    session.commit()
    return JoinResponse(
        run_id=run.id,
        peer_id=joined.peer.peer_id,
        peer_token=joined.peer_token,
        certificate=joined.certificate.to_base64(),
        certificate_expires_at=joined.certificate_expires_at,
        run_public_key=encode_bytes(run.authority_public_key),
        run_name=run.name,
        status=run.status,
        task=run.task,
        config=run.config,
        bootstrap=[bootstrap_peer(p) for p in joined.bootstrap],
        checkpoint=None if checkpoint is None else checkpoint_service.public(checkpoint),
        report_interval_s=settings.report_interval_s,
        relays=list(settings.relays),
    )


@router.post(
    "/reachability",
    response_model=ReachabilityPublic,
    responses={429: {"model": ErrorPublic, "description": "Probed too recently; Retry-After."}},
)
async def check_reachability(
    peer: CurrentPeer,
    session: SessionDep,
    settings: SettingsDep,
    body: ReachabilityRequest,
    request: Request,
) -> ReachabilityPublic:
    """Have the coordinator try to connect to the calling peer's ports, at the address the
    request comes from, and announce the peer accordingly: ``ws://host:port`` when it
    answered, no address and client mode otherwise. Once per ``reachability_interval_s``
    (429 with ``Retry-After`` before)."""
    assert peer.peer_pk is not None
    return await reachability_service.check(
        session,
        peer.peer_pk,
        request.client.host if request.client else None,
        body.port,
        body.bulk_port,
        interval_s=settings.reachability_interval_s,
        timeout_s=settings.reachability_timeout_s,
        punch_port=body.punch_port,
    )


@router.get("/rendezvous", response_model=RendezvousPublic, responses=_RATE_LIMITED)
def rendezvous(
    peer: CurrentPeer, session: SessionDep, settings: SettingsDep, run: RunDep
) -> RendezvousPublic:
    """The run's peers behind NATs that punch (never the caller): each one's public address
    as the coordinator saw it, the port it punches from, and its addresses at the
    coordinator's relays. A punching peer keeps a direct link with each
    (``peer.node.punching``), or one through a relay where the punch does not get through;
    where a punch goes comes from here, never from what a peer announces."""
    assert peer.peer_pk is not None
    peer_service.touch(session, peer.peer_pk)
    session.commit()
    since = now_ms() - int(settings.peer_online_ttl_s * 1000)
    found = reachability_service.rendezvous_peers(
        session,
        run.id,
        exclude=peer.peer_pk,
        online_since_ms=since,
        limit=settings.rendezvous_peers,
    )
    return RendezvousPublic(
        peers=[
            RendezvousPeer(
                peer_id=p, host=h, port=port, relays=[f"{r}/{p}" for r in settings.relays]
            )
            for p, h, port in found
        ]
    )


@router.get("/bootstrap", response_model=BootstrapPublic, responses=_RATE_LIMITED)
def bootstrap(
    peer: CurrentPeer, session: SessionDep, settings: SettingsDep, run: RunDep
) -> BootstrapPublic:
    """A random sample of peers seen recently (never the caller, never client-mode peers).
    Calling it also counts as a sign of life."""
    assert peer.peer_pk is not None
    peer_service.touch(session, peer.peer_pk)
    session.commit()
    peers = peer_service.sample_live_peers(
        session,
        run.id,
        exclude=peer.peer_pk,
        online_ttl_s=settings.peer_online_ttl_s,
        limit=settings.bootstrap_peers,
    )
    return BootstrapPublic(peers=[bootstrap_peer(p) for p in peers])


@router.post("/leave", status_code=status.HTTP_204_NO_CONTENT, responses=_RATE_LIMITED)
def leave(peer: CurrentPeer, session: SessionDep) -> Response:
    """The calling peer stops: it shows offline at once, and online again with its next
    report or join. Only a peer's own token makes it leave; calling it again changes
    nothing."""
    assert peer.peer_pk is not None
    peer_service.leave(session, peer.peer_pk)
    session.commit()
    return Response(status_code=status.HTTP_204_NO_CONTENT)


@router.post("/certificate", response_model=CertificatePublic, responses=_RATE_LIMITED)
def renew_certificate(
    peer: CurrentPeer, session: SessionDep, settings: SettingsDep, keybox: KeyBoxDep, run: RunDep
) -> CertificatePublic:
    """A fresh certificate for the calling peer, before the old one expires. Also moves the
    peer token's expiry to ``peer_token_ttl_s`` from now."""
    peer_service.ensure_accepting(run, "renew a certificate")
    record = session.get(Peer, peer.peer_pk)
    assert record is not None  # the token's foreign key cascades with the peer
    volunteer_service.ensure_not_banned(record.volunteer)
    certificate, expires_at = peer_service.issue_certificate(
        keybox, run, record, settings.certificate_ttl_s
    )
    peer_service.touch(session, record.id)
    token_service.extend_peer_token(session, peer.token_id, settings.peer_token_ttl_s)
    session.commit()
    return CertificatePublic(certificate=certificate.to_base64(), certificate_expires_at=expires_at)


@reports_router.post(
    "/reports",
    status_code=status.HTTP_202_ACCEPTED,
    response_model=ReportAccepted,
    responses={422: {"model": ErrorPublic, "description": "Invalid, or past a plausibility "
                     "bound (the detail names it); counted against the peer."}, **_RATE_LIMITED},
)  # fmt: skip
async def post_report(
    peer: ReportingPeer, guard: ReportGuardDep, buffer: ReportBufferDep, body: ReportCreate
) -> Response:
    """Record a progress report. Accepted (202) means it will be stored — within
    ``report_flush_interval_s``, or once the database is back if it is unavailable. A report
    no honest peer could send (see docs/coordinator.md) is refused with 422 and counted
    against the peer. A finished run answers 409: the peer should stop."""
    assert peer.run_id is not None and peer.peer_pk is not None
    await take_report(guard, buffer, peer.run_id, peer.peer_pk, body)
    # Pre-rendered: this route is the hot path, and the answer never changes.
    return Response(_ACCEPTED, status_code=status.HTTP_202_ACCEPTED, media_type="application/json")
