"""FastAPI dependencies as ``Annotated`` aliases. Scope and run checks live here, once.

Dependencies that do no I/O are ``async def``: FastAPI runs every plain ``def`` dependency in
its thread pool, and each such hop costs far more than the work in these few lines. Only
those that query the database are ``def``.

Order of checks on every protected route: a missing or invalid token is 401; a valid token
of the wrong scope, or bound to another run, is 403; only then is an unknown id a 404.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Annotated

from fastapi import Depends, Path, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from sqlalchemy.orm import Session

from server.config import Settings
from server.exceptions import Conflict, Forbidden, Unauthenticated
from server.models import Run, RunStatus, Token, TokenScope, utcnow
from server.security import JoinChallenges, KeyBox, PrincipalCache, parse_token
from server.services import runs as run_service
from server.services import tokens as token_service
from server.services.checkpoints import CheckpointStore
from server.services.report_bounds import PeerTrack
from server.services.report_buffer import ReportBuffer
from server.services.report_guard import ReportGuard, load_track
from server.services.tokens import Principal

_bearer = HTTPBearer(auto_error=False, description="A token issued by this coordinator.")


async def get_settings(request: Request) -> Settings:
    settings: Settings = request.app.state.settings
    return settings


async def get_session(request: Request) -> AsyncIterator[Session]:
    # Creating a session does no I/O (it takes a connection when first used). Closing one
    # that still holds a transaction rolls it back, a round trip to the database: that goes
    # to the thread pool rather than blocking the event loop.
    session: Session = request.app.state.session_factory()
    try:
        yield session
    finally:
        if session.in_transaction():
            await run_in_threadpool(session.close)
        else:
            session.close()


async def get_keybox(request: Request) -> KeyBox:
    keybox: KeyBox = request.app.state.keybox
    return keybox


async def get_join_challenges(request: Request) -> JoinChallenges:
    join_challenges: JoinChallenges = request.app.state.join_challenges
    return join_challenges


async def get_checkpoint_store(request: Request) -> CheckpointStore:
    checkpoint_store: CheckpointStore = request.app.state.checkpoint_store
    return checkpoint_store


async def get_report_guard(request: Request) -> ReportGuard:
    report_guard: ReportGuard = request.app.state.report_guard
    return report_guard


async def get_report_buffer(request: Request) -> ReportBuffer:
    buffer: ReportBuffer | None = getattr(request.app.state, "report_buffer", None)
    if buffer is None:  # the ASGI server did not run the app's lifespan
        raise RuntimeError("the report buffer is not running; serve the app with lifespan on")
    return buffer


SettingsDep = Annotated[Settings, Depends(get_settings)]
SessionDep = Annotated[Session, Depends(get_session)]
KeyBoxDep = Annotated[KeyBox, Depends(get_keybox)]
ReportBufferDep = Annotated[ReportBuffer, Depends(get_report_buffer)]
ReportGuardDep = Annotated[ReportGuard, Depends(get_report_guard)]
JoinChallengesDep = Annotated[JoinChallenges, Depends(get_join_challenges)]
CheckpointStoreDep = Annotated[CheckpointStore, Depends(get_checkpoint_store)]
RunIdPath = Annotated[str, Path(min_length=1, max_length=32, description="The run's id.")]


def get_principal(
    session: SessionDep,
    settings: SettingsDep,
    credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)],
) -> Principal:
    if credentials is None:
        raise Unauthenticated("missing bearer token: send 'Authorization: Bearer <token>'")
    admin = settings.admin_token.get_secret_value() if settings.admin_token else None
    return token_service.authenticate(session, credentials.credentials, admin)


CurrentPrincipal = Annotated[Principal, Depends(get_principal)]


def get_join_principal(
    session: SessionDep,
    settings: SettingsDep,
    credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)],
) -> Principal:
    """Like :func:`get_principal`, but a join token that reached its ``max_uses`` passes:
    the join service decides, since joining again with a known key uses nothing up."""
    if credentials is None:
        raise Unauthenticated("missing bearer token: send 'Authorization: Bearer <token>'")
    admin = settings.admin_token.get_secret_value() if settings.admin_token else None
    return token_service.authenticate(session, credentials.credentials, admin, allow_used_up=True)


JoinPrincipal = Annotated[Principal, Depends(get_join_principal)]


def _need(principal: Principal, scope: TokenScope, action: str) -> None:
    if principal.scope is not scope:
        raise Forbidden(
            f"{action} needs a {scope.value} token, not a {principal.scope.value} token"
        )


async def get_organizer(principal: CurrentPrincipal) -> Principal:
    _need(principal, TokenScope.organizer, "this endpoint")
    return principal


CurrentOrganizer = Annotated[Principal, Depends(get_organizer)]


def _run_token(principal: Principal, run_id: str, scope: TokenScope, action: str) -> Principal:
    _need(principal, scope, action)
    if principal.run_id != run_id:
        raise Forbidden(f"this {scope.value} token belongs to another run")
    return principal


async def get_joiner(principal: JoinPrincipal, run_id: RunIdPath) -> Principal:
    return _run_token(principal, run_id, TokenScope.join, "joining a run")


async def get_invitee(principal: JoinPrincipal) -> Principal:
    """A join token of any run (the run is the token's)."""
    _need(principal, TokenScope.join, "asking for a join challenge")
    return principal


async def get_peer(principal: CurrentPrincipal, run_id: RunIdPath) -> Principal:
    return _run_token(principal, run_id, TokenScope.peer, "this peer endpoint")


async def get_run_reader(principal: CurrentPrincipal, run_id: RunIdPath) -> Principal:
    """An organizer, or a peer of this run."""
    if principal.scope is TokenScope.organizer:
        return principal
    if principal.scope is TokenScope.peer:
        return _run_token(principal, run_id, TokenScope.peer, "this endpoint")
    raise Forbidden(
        f"this endpoint needs an organizer token or a peer token of the run, not a "
        f"{principal.scope.value} token"
    )


async def get_task_reader(principal: JoinPrincipal, run_id: RunIdPath) -> Principal:
    """An organizer, or an invitee or a peer of this run: who may read the task it ships
    (an invitee reads it before joining, so a task it cannot run spends no invite)."""
    if principal.scope is TokenScope.organizer:
        return principal
    if principal.run_id != run_id:
        raise Forbidden(f"this {principal.scope.value} token belongs to another run")
    return principal


CurrentJoiner = Annotated[Principal, Depends(get_joiner)]
CurrentInvitee = Annotated[Principal, Depends(get_invitee)]
CurrentPeer = Annotated[Principal, Depends(get_peer)]
CurrentRunReader = Annotated[Principal, Depends(get_run_reader)]
TaskReader = Annotated[Principal, Depends(get_task_reader)]


def get_run(session: SessionDep, run_id: RunIdPath) -> Run:
    return run_service.get_run(session, run_id)


RunDep = Annotated[Run, Depends(get_run)]


def _load_reporting_peer(
    request: Request, settings: Settings, token: str, run_id: str
) -> tuple[Principal, PeerTrack, float | None]:
    """The principal, its peer's track, and the seconds its token has left (None: no
    expiry)."""
    with request.app.state.session_factory() as session:
        admin = settings.admin_token.get_secret_value() if settings.admin_token else None
        principal = token_service.authenticate(session, token, admin)
        _run_token(principal, run_id, TokenScope.peer, "this peer endpoint")
        run = run_service.get_run(session, run_id)
        if run.archived_at is not None or run.status is RunStatus.finished:
            raise Conflict(f"run {run.id} is finished; stop training and leave the run")
        assert principal.peer_pk is not None  # peer tokens belong to a peer
        row = session.get(Token, principal.token_id)  # read by authenticate: no query
        expires = None if row is None else row.expires_at
        left = None if expires is None else (expires - utcnow()).total_seconds()
        return principal, load_track(session, principal.peer_pk), left


async def get_reporting_peer(
    request: Request,
    settings: SettingsDep,
    credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)],
    run_id: RunIdPath,
) -> Principal:
    """The hot path of report ingestion. Authentication, the scope and run checks and the
    run's state (finished or archived: 409) are looked up in one trip to the thread pool,
    and a success is reused for ``peer_auth_cache_ttl_s`` (see :class:`PrincipalCache`)
    unless revoked meanwhile (:mod:`server.services.revocation_sweep`). The same trip reads
    the peer's track for the plausibility bounds."""
    if credentials is None:
        raise Unauthenticated("missing bearer token: send 'Authorization: Bearer <token>'")
    cache: PrincipalCache = request.app.state.principal_cache
    parsed = parse_token(credentials.credentials)
    if parsed is not None:
        cached = cache.get(parsed.id, parsed.secret)
        if isinstance(cached, Principal) and cached.run_id == run_id:
            return cached
    principal, track, left = await run_in_threadpool(
        _load_reporting_peer, request, settings, credentials.credentials, run_id
    )
    assert principal.peer_pk is not None
    request.app.state.report_guard.remember(principal.peer_pk, track)
    if parsed is not None:
        cache.put(parsed.id, parsed.secret, principal, run_id=run_id, expires_in_s=left)
    sweep = getattr(request.app.state, "revocation_sweep", None)
    if sweep is not None and settings.peer_auth_cache_ttl_s > 0:
        # A run this worker meets (a peer of it authenticated): its other peers' tokens
        # in one query, rather than one report at a time.
        sweep.warm_soon(run_id, request.app.state.report_guard.remember)
    return principal


ReportingPeer = Annotated[Principal, Depends(get_reporting_peer)]
