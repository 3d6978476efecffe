"""The pages: runs list, run dashboard, volunteer page, invite page and organizer sign-in.
Server-rendered with the current numbers (they work without JavaScript); the scripts in
``web/static/js`` then keep them live over the WebSockets of
``server.api.routes.dashboard``. The organizer's forms are in :mod:`server.web.organizer`.

Every form carries the CSRF token of :mod:`server.web.security`; every POST checks it first."""

from __future__ import annotations

from typing import Annotated, Any
from urllib.parse import quote

from fastapi import APIRouter, Form, Request
from fastapi.responses import HTMLResponse, RedirectResponse, Response

from server.api.deps import SessionDep, SettingsDep
from server.api.routes.dashboard import cached_run_dashboard, cached_runs_overview
from server.config import Settings
from server.exceptions import NotFound, Unauthenticated
from server.models import TokenScope, Volunteer
from server.schemas_dashboard import RunDashboard, RunsOverview
from server.security import parse_token
from server.services import checkpoints as checkpoint_service
from server.services import dashboard as dashboard_service
from server.services import runs as run_service
from server.services import tokens as token_service
from server.services import volunteer_table
from server.services import volunteers as volunteer_service
from server.web.credential_cookie import (
    KEEP_S,
    CredentialSeal,
    KeptCredential,
    cookie_name,
    cookie_path,
)
from server.web.organizer import ban_offer_for
from server.web.rendering import (
    CsrfField,
    Organizer,
    PageError,
    check_csrf,
    find_run,
    render,
    secure_cookies,
)
from server.web.security import ORGANIZER_COOKIE

router = APIRouter(include_in_schema=False)


@router.get("/", response_class=HTMLResponse)
def runs_page(
    request: Request, session: SessionDep, settings: SettingsDep, organizer: Organizer
) -> HTMLResponse:
    if organizer is None:  # anyone: the worker's cached document, as the API serves it
        cached = cached_runs_overview(request, settings)
        overview = RunsOverview.model_validate_json(bytes(cached.body))
    else:  # the organizer sees at once what it just did
        overview = dashboard_service.runs_overview(session, online_ttl_s=settings.peer_online_ttl_s)
    return render(request, "runs.html", {"overview": overview}, organizer=organizer)


@router.get("/runs/{run_id}", response_class=HTMLResponse)
def run_page(
    request: Request,
    run_id: str,
    session: SessionDep,
    settings: SettingsDep,
    organizer: Organizer,
) -> HTMLResponse:
    run = find_run(session, run_id)
    view = volunteer_table.view_from_query(request.query_params)
    if organizer is None:
        # Anyone: the run's cached document with the table's page read now, as the API
        # serves it, so that varied queries cost no build.
        cached = cached_run_dashboard(request, session, settings, run, view)
        document = RunDashboard.model_validate_json(bytes(cached.body))
    else:  # the organizer sees at once what it just did
        document = dashboard_service.run_dashboard(
            session,
            run,
            online_ttl_s=settings.peer_online_ttl_s,
            history_points=settings.history_points,
            view=view,
        )
    invites = []
    checkpoints: list[Any] = []
    ban_offer = None
    if organizer is not None:
        invites = [
            t
            for t in token_service.list_join_tokens(session, run)
            if t.volunteer_id is None and token_service.is_active(t)
        ]
        checkpoints = checkpoint_service.list_checkpoints(session, run.id)
        ban_offer = ban_offer_for(session, run, request.query_params.get("banned", ""))
    return render(
        request,
        "run.html",
        {
            "document": document,
            "invites": invites,
            "checkpoints": checkpoints,
            "served_checkpoint": checkpoint_service.served(session, run.id) if organizer else None,
            "ban_offer": ban_offer,
            "new_invite": request.query_params.get("invite"),
            "public_url": settings.public_url.rstrip("/"),
            # What an invite made with empty fields gets.
            "default_uses": settings.join_token_default_max_uses,
            "default_hours": f"{settings.join_token_default_ttl_s / 3600:g}",
        },
        organizer=organizer,
    )


@router.get("/runs/{run_id}/volunteers/{ref}", response_class=HTMLResponse)
def volunteer_page(
    request: Request,
    run_id: str,
    ref: str,
    session: SessionDep,
    settings: SettingsDep,
    organizer: Organizer,
) -> HTMLResponse:
    run = find_run(session, run_id)
    try:
        detail = dashboard_service.volunteer_detail(
            session,
            run,
            ref[:64],
            online_ttl_s=settings.peer_online_ttl_s,
            retention_s=settings.report_retention_s,
        )
    except NotFound:
        raise PageError(404, "This run has no such volunteer.") from None
    return render(request, "volunteer.html", {"detail": detail}, organizer=organizer)


def _invite_status(exc: volunteer_service.InviteUnusable) -> int:
    return 410 if exc.gone else 404


def _seal(request: Request) -> CredentialSeal:
    settings: Settings = request.app.state.settings
    return CredentialSeal(settings.secret_key.get_secret_value())


def _kept(request: Request, invite: str) -> KeptCredential | None:
    """The credential this browser was given for this invite, if it still holds it."""
    parsed = parse_token(invite)
    if parsed is None:
        return None
    return _seal(request).open(parsed.id, request.cookies.get(cookie_name(parsed.id)))


def _credential_url(invite: str) -> str:
    return f"/join/{quote(invite, safe='')}/credential"


@router.get("/join/{invite}", response_class=HTMLResponse)
def invite_page(
    request: Request, invite: str, session: SessionDep, organizer: Organizer
) -> Response:
    invite = invite[:200]
    if _kept(request, invite) is not None:  # this browser already has its credential
        return RedirectResponse(_credential_url(invite), status_code=303)
    try:
        found = volunteer_service.inspect_invite(session, invite)
    except volunteer_service.InviteUnusable as exc:
        return render(request, "join.html", {"problem": str(exc)}, status=_invite_status(exc))
    return render(request, "join.html", {"run": found.run}, organizer=organizer)


@router.post("/join/{invite}", response_class=HTMLResponse)
def redeem_invite(
    request: Request,
    invite: str,
    session: SessionDep,
    settings: SettingsDep,
    csrf: CsrfField = None,
    display_name: Annotated[str, Form()] = "",
) -> Response:
    """Issue a credential, then redirect to the page that shows it (POST/redirect/GET). A
    browser that already got one for this invite is sent to it: nothing is issued twice."""
    check_csrf(request, csrf)
    invite = invite[:200]
    if _kept(request, invite) is not None:
        return RedirectResponse(_credential_url(invite), status_code=303)
    try:
        redeemed = volunteer_service.redeem_invite(
            session, invite, display_name, token_ttl_s=settings.join_token_default_ttl_s
        )
    except volunteer_service.InviteUnusable as exc:
        return render(request, "join.html", {"problem": str(exc)}, status=_invite_status(exc))
    except ValueError as exc:
        found = volunteer_service.inspect_invite(session, invite)
        message = str(exc)
        if not isinstance(exc, volunteer_service.NameTaken):
            message = message[:1].upper() + message[1:] + "."
        return render(
            request,
            "join.html",
            {"run": found.run, "name_error": message, "display_name": display_name},
            status=422,
        )
    session.commit()
    invite_id = redeemed.volunteer.join_token_id
    assert invite_id is not None  # redeemed from this invite
    response = RedirectResponse(_credential_url(invite), status_code=303)
    response.set_cookie(
        cookie_name(invite_id),
        _seal(request).seal(invite_id, KeptCredential(redeemed.volunteer.id, redeemed.token)),
        max_age=KEEP_S,
        path=cookie_path(invite),
        httponly=True,
        samesite="strict",
        secure=secure_cookies(settings),
    )
    return response


@router.get("/join/{invite}/credential", response_class=HTMLResponse)
def credential_page(
    request: Request, invite: str, session: SessionDep, settings: SettingsDep
) -> Response:
    """The credential this browser was issued for the invite, as often as it reloads."""
    invite = invite[:200]
    kept = _kept(request, invite)
    if kept is None:
        return RedirectResponse(f"/join/{quote(invite, safe='')}", status_code=303)
    volunteer = session.get(Volunteer, kept.volunteer_id)
    if volunteer is None:
        raise PageError(410, "This credential no longer exists.")
    if volunteer.banned_at is not None:
        raise PageError(410, "This volunteer was banned from the run.")
    run = run_service.get_run(session, volunteer.run_id)
    url = settings.public_url.rstrip("/")
    return render(
        request,
        "joined.html",
        {
            "run": run,
            "volunteer": volunteer,
            "token": kept.token,
            "command": ["swarmgrad", "join", url, "--token", kept.token],
        },
    )


@router.get("/signin", response_class=HTMLResponse)
def signin_page(request: Request, organizer: Organizer) -> HTMLResponse:
    return render(request, "signin.html", {"next": _next(request)}, organizer=organizer)


@router.post("/signin")
def signin(
    request: Request,
    session: SessionDep,
    settings: SettingsDep,
    csrf: CsrfField = None,
    token: Annotated[str, Form()] = "",
    next: Annotated[str, Form()] = "/",
) -> Response:
    check_csrf(request, csrf)
    admin = settings.admin_token.get_secret_value() if settings.admin_token else None
    try:
        principal = token_service.authenticate(session, token.strip(), admin)
        if principal.scope is not TokenScope.organizer:
            raise Unauthenticated("not an organizer token")
    except Unauthenticated:
        return render(
            request,
            "signin.html",
            {"error": "That is not a valid organizer token.", "next": _safe_next(next)},
            status=401,
        )
    response = RedirectResponse(_safe_next(next), status_code=303)
    response.set_cookie(
        ORGANIZER_COOKIE,
        token.strip(),
        httponly=True,
        samesite="strict",
        secure=secure_cookies(settings),
        path="/",
    )
    return response


@router.post("/signout")
def signout(request: Request, csrf: CsrfField = None) -> Response:
    check_csrf(request, csrf)
    response = RedirectResponse("/", status_code=303)
    response.delete_cookie(ORGANIZER_COOKIE, path="/", httponly=True, samesite="strict")
    return response


def _next(request: Request) -> str:
    return _safe_next(request.query_params.get("next", "/"))


def _safe_next(value: str) -> str:
    """Only a path on this site: never an open redirect."""
    if not value.startswith("/") or value.startswith("//") or "\\" in value:
        return "/"
    return value
