"""Peer endpoints: join with a join token; then bootstrap, certificate renewal and reports
with the peer token issued at join."""

from __future__ import annotations

from fastapi import APIRouter, Response, status

from server.api import API_PREFIX
from server.api.deps import (
    CurrentJoiner,
    CurrentOrganizer,
    CurrentPeer,
    KeyBoxDep,
    ReportBufferDep,
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
    JoinRequest,
    JoinResponse,
    PeerPublic,
    PeersPublic,
    ReportAccepted,
    ReportCreate,
    encode_bytes,
)
from server.services import peers as peer_service
from server.services.reports import PendingReport

router = APIRouter(prefix=f"{API_PREFIX}/runs/{{run_id}}", tags=["peers"])
# Its own router so that the app can match it before every other route.
reports_router = APIRouter(prefix=f"{API_PREFIX}/runs/{{run_id}}", tags=["peers"])
_ACCEPTED = ReportAccepted().model_dump_json().encode()


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
                online=p.last_seen_ms >= online_since,
                first_seen_at=ms_to_datetime(p.first_seen_ms),
                last_seen_at=ms_to_datetime(p.last_seen_ms),
                last_report_at=None
                if p.last_report_ms is None
                else ms_to_datetime(p.last_report_ms),
                epoch=p.epoch,
                samples=p.samples_base + p.samples,
                samples_per_second=p.samples_per_second,
                loss=p.loss,
            )
            for p in peer_service.list_peers(session, run.id)
        ]
    )


@router.post("/join", response_model=JoinResponse)
def join_run(
    joiner: CurrentJoiner,
    session: SessionDep,
    settings: SettingsDep,
    keybox: KeyBoxDep,
    run: RunDep,
    body: JoinRequest,
) -> JoinResponse:
    """Trade a join token for a peer token and a run certificate. Refused (409) while the
    run is paused, finished or archived. Next: start a ``peer.Node`` with
    ``CertificateAuth(certificate, CertificateVerifier(run_public_key, run_id))`` and the
    bootstrap peers as initial peers."""
    joined = peer_service.join(
        session,
        keybox,
        run,
        joiner.token_id,
        body,
        certificate_ttl_s=settings.certificate_ttl_s,
        online_ttl_s=settings.peer_online_ttl_s,
        bootstrap_size=settings.bootstrap_peers,
    )
    session.commit()
    return JoinResponse(
        run_id=run.id,
        peer_id=joined.peer.peer_id,
        peer_token=joined.peer_token,
        certificate=joined.certificate.to_base64(),
        certificate_expires_at=joined.certificate_expires_at,
        run_public_key=encode_bytes(run.authority_public_key),
        task=run.task,
        config=run.config,
        bootstrap=[bootstrap_peer(p) for p in joined.bootstrap],
    )


@router.get("/bootstrap", response_model=BootstrapPublic)
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


@router.post("/certificate", response_model=CertificatePublic)
def renew_certificate(
    peer: CurrentPeer, session: SessionDep, settings: SettingsDep, keybox: KeyBoxDep, run: RunDep
) -> CertificatePublic:
    """A fresh certificate for the calling peer, before the old one expires."""
    peer_service.ensure_accepting(run, "renew a certificate")
    record = session.get(Peer, peer.peer_pk)
    assert record is not None  # the token's foreign key cascades with the peer
    certificate, expires_at = peer_service.issue_certificate(
        keybox, run, record, settings.certificate_ttl_s
    )
    peer_service.touch(session, record.id)
    session.commit()
    return CertificatePublic(certificate=certificate.to_base64(), certificate_expires_at=expires_at)


@reports_router.post(
    "/reports", status_code=status.HTTP_202_ACCEPTED, response_model=ReportAccepted
)
async def post_report(peer: ReportingPeer, buffer: ReportBufferDep, body: ReportCreate) -> Response:
    """Record a progress report. Accepted (202) means it will be stored within
    ``report_flush_interval_s``, even if this worker shuts down cleanly meanwhile. A finished
    run answers 409: the peer should stop."""
    assert peer.run_id is not None and peer.peer_pk is not None
    await buffer.add(
        PendingReport(
            run_id=peer.run_id,
            peer_pk=peer.peer_pk,
            reported_ms=now_ms(),
            epoch=body.epoch,
            samples=body.samples,
            samples_per_second=body.samples_per_second,
            loss=body.loss,
            group_size=body.group_size,
        )
    )
    # Pre-rendered: this route is the hot path, and the answer never changes.
    return Response(_ACCEPTED, status_code=status.HTTP_202_ACCEPTED, media_type="application/json")
