"""FastAPI dependencies as ``Annotated`` aliases. Scope and run checks live here, once.

Order of checks on every protected route: a missing or invalid token is 401; a valid token
of the wrong scope, or bound to another run, is 403; only then is an unknown id a 404.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Annotated

from fastapi import Depends, Path, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from sqlalchemy.orm import Session

from server.config import Settings
from server.exceptions import Forbidden, Unauthenticated
from server.models import Run, TokenScope
from server.security import KeyBox
from server.services import runs as run_service
from server.services import tokens as token_service
from server.services.reports import ReportBuffer
from server.services.tokens import Principal

_bearer = HTTPBearer(auto_error=False, description="A token issued by this coordinator.")


def get_settings(request: Request) -> Settings:
    return request.app.state.settings


def get_session(request: Request) -> Iterator[Session]:
    with request.app.state.session_factory() as session:
        yield session


def get_keybox(request: Request) -> KeyBox:
    return request.app.state.keybox


def get_report_buffer(request: Request) -> ReportBuffer:
    buffer = getattr(request.app.state, "report_buffer", None)
    if buffer is None:  # the ASGI server did not run the app's lifespan
        raise RuntimeError("the report buffer is not running; serve the app with lifespan on")
    return buffer


SettingsDep = Annotated[Settings, Depends(get_settings)]
SessionDep = Annotated[Session, Depends(get_session)]
KeyBoxDep = Annotated[KeyBox, Depends(get_keybox)]
ReportBufferDep = Annotated[ReportBuffer, Depends(get_report_buffer)]
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


def _need(principal: Principal, scope: TokenScope, action: str) -> None:
    if principal.scope is not scope:
        raise Forbidden(
            f"{action} needs a {scope.value} token, not a {principal.scope.value} token"
        )


def get_organizer(principal: CurrentPrincipal) -> Principal:
    _need(principal, TokenScope.organizer, "this endpoint")
    return principal


CurrentOrganizer = Annotated[Principal, Depends(get_organizer)]


def _run_token(principal: Principal, run_id: str, scope: TokenScope, action: str) -> Principal:
    _need(principal, scope, action)
    if principal.run_id != run_id:
        raise Forbidden(f"this {scope.value} token belongs to another run")
    return principal


def get_joiner(principal: CurrentPrincipal, run_id: RunIdPath) -> Principal:
    return _run_token(principal, run_id, TokenScope.join, "joining a run")


def get_peer(principal: CurrentPrincipal, run_id: RunIdPath) -> Principal:
    return _run_token(principal, run_id, TokenScope.peer, "this peer endpoint")


CurrentJoiner = Annotated[Principal, Depends(get_joiner)]
CurrentPeer = Annotated[Principal, Depends(get_peer)]


def get_run(session: SessionDep, run_id: RunIdPath) -> Run:
    return run_service.get_run(session, run_id)


RunDep = Annotated[Run, Depends(get_run)]
