"""The pages: runs list, run dashboard, volunteer page, invite page, organizer sign-in, and the
organizer's forms. Server-rendered with the current numbers (they work without JavaScript);
the scripts in ``web/static/js`` then keep them live over the WebSockets of
``server.api.routes.dashboard``.

Every form carries the CSRF token of :mod:`server.web.security`; every POST checks it first.
Organizer forms answer with a redirect back to the page (POST/redirect/GET), carrying what
happened in the query string only when it is no secret."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any
from urllib.parse import quote

from fastapi import APIRouter, Depends, Form, Request
from fastapi.responses import FileResponse, HTMLResponse, RedirectResponse, Response
from fastapi.templating import Jinja2Templates

from server.api.deps import SessionDep, SettingsDep
from server.config import Settings
from server.exceptions import CoordinatorError, NotFound, Unauthenticated
from server.models import RunStatus, TokenScope
from server.schemas import RunUpdate, TokenCreate
from server.services import checkpoints as checkpoint_service
from server.services import dashboard as dashboard_service
from server.services import runs as run_service
from server.services import tokens as token_service
from server.services import volunteers as volunteer_service
from server.web.security import (
    CSRF_COOKIE,
    CSRF_FIELD,
    ORGANIZER_COOKIE,
    csrf_matches,
    new_csrf_token,
)


def _web_dir() -> Path:
    """Installed: the data package ``server.web.assets``; in the repository: ``web/``."""
    installed = Path(__file__).resolve().parent / "assets"
    if (installed / "templates").is_dir():
        return installed
    return Path(__file__).resolve().parents[2] / "web"


WEB_DIR = _web_dir()
templates = Jinja2Templates(directory=WEB_DIR / "templates")

router = APIRouter(include_in_schema=False)


class PageError(Exception):
    """Rendered as the error page with ``status`` and ``message``."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


def organizer_token(request: Request, session: SessionDep, settings: SettingsDep) -> str | None:
    """The signed-in organizer's token, if the cookie holds one that is still valid."""
    token = request.cookies.get(ORGANIZER_COOKIE)
    if not token:
        return None
    admin = settings.admin_token.get_secret_value() if settings.admin_token else None
    try:
        principal = token_service.authenticate(session, token, admin)
    except Unauthenticated:
        return None
    return token if principal.scope is TokenScope.organizer else None


Organizer = Annotated[str | None, Depends(organizer_token)]


def _secure(settings: Settings) -> bool:
    return settings.public_url.startswith("https://")


def render(
    request: Request,
    name: str,
    context: dict[str, Any],
    *,
    status: int = 200,
    organizer: str | None = None,
) -> HTMLResponse:
    """A template with the CSRF token (set as a cookie if the browser has none)."""
    csrf = request.cookies.get(CSRF_COOKIE) or new_csrf_token()
    response = templates.TemplateResponse(
        request,
        name,
        {**context, "csrf": csrf, "csrf_field": CSRF_FIELD, "signed_in": organizer is not None},
        status_code=status,
    )
    if request.cookies.get(CSRF_COOKIE) != csrf:
        settings: Settings = request.app.state.settings
        response.set_cookie(
            CSRF_COOKIE, csrf, httponly=True, samesite="strict", secure=_secure(settings)
        )
    return response


def check_csrf(request: Request, field: str | None) -> None:
    if not csrf_matches(request.cookies.get(CSRF_COOKIE), field):
        raise PageError(
            403,
            "This form has expired or did not come from this site. Go back, reload the page "
            "and try again.",
        )


def require_organizer(organizer: str | None) -> str:
    if organizer is None:
        raise PageError(403, "Sign in as an organizer first.")
    return organizer


CsrfField = Annotated[str | None, Form(alias=CSRF_FIELD)]


# ----------------------------------------------------------------------------- pages


@router.get("/", response_class=HTMLResponse)
def runs_page(
    request: Request, session: SessionDep, settings: SettingsDep, organizer: Organizer
) -> HTMLResponse:
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
    run = _run(session, run_id)
    document = dashboard_service.run_dashboard(
        session,
        run,
        online_ttl_s=settings.peer_online_ttl_s,
        history_points=settings.history_points,
    )
    invites = []
    if organizer is not None:
        invites = [
            t
            for t in token_service.list_join_tokens(session, run)
            if t.volunteer_id is None and token_service.is_active(t)
        ]
    return render(
        request,
        "run.html",
        {
            "document": document,
            "invites": invites,
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
    run = _run(session, run_id)
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


@router.get("/join/{invite}", response_class=HTMLResponse)
def invite_page(
    request: Request, invite: str, session: SessionDep, organizer: Organizer
) -> HTMLResponse:
    try:
        found = volunteer_service.inspect_invite(session, invite[:200])
    except volunteer_service.InviteUnusable as exc:
        return render(request, "join.html", {"problem": str(exc)})
    return render(request, "join.html", {"run": found.run}, organizer=organizer)


@router.post("/join/{invite}", response_class=HTMLResponse)
def redeem_invite(
    request: Request,
    invite: str,
    session: SessionDep,
    settings: SettingsDep,
    csrf: CsrfField = None,
    display_name: Annotated[str, Form()] = "",
) -> HTMLResponse:
    check_csrf(request, csrf)
    try:
        redeemed = volunteer_service.redeem_invite(
            session, invite[:200], display_name, token_ttl_s=settings.join_token_default_ttl_s
        )
    except volunteer_service.InviteUnusable as exc:
        return render(request, "join.html", {"problem": str(exc)})
    except ValueError as exc:
        found = volunteer_service.inspect_invite(session, invite[:200])
        return render(
            request,
            "join.html",
            {"run": found.run, "name_error": str(exc), "display_name": display_name},
            status=422,
        )
    session.commit()
    url = settings.public_url.rstrip("/")
    return render(
        request,
        "joined.html",
        {
            "run": redeemed.run,
            "volunteer": redeemed.volunteer,
            "token": redeemed.token,
            "command": f"swarmgrad join {url} --token {redeemed.token}",
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
        secure=_secure(settings),
        path="/",
    )
    return response


@router.post("/signout")
def signout(request: Request, csrf: CsrfField = None) -> Response:
    check_csrf(request, csrf)
    response = RedirectResponse("/", status_code=303)
    response.delete_cookie(ORGANIZER_COOKIE, path="/", httponly=True, samesite="strict")
    return response


# ----------------------------------------------------------------------------- organizer


@router.post("/runs/{run_id}/actions/{action}")
def run_action(
    request: Request,
    run_id: str,
    action: str,
    session: SessionDep,
    organizer: Organizer,
    csrf: CsrfField = None,
) -> Response:
    check_csrf(request, csrf)
    require_organizer(organizer)
    statuses = {
        "pause": RunStatus.paused,
        "resume": RunStatus.running,
        "finish": RunStatus.finished,
    }
    if action not in statuses:
        raise PageError(404, "There is no such action.")
    run = _run(session, run_id)
    try:
        run_service.update_run(session, run, RunUpdate(status=statuses[action]))
    except CoordinatorError as exc:
        raise PageError(exc.status_code, exc.detail) from None
    session.commit()
    return RedirectResponse(f"/runs/{run.id}", status_code=303)


@router.post("/runs/{run_id}/invites")
def create_invite(
    request: Request,
    run_id: str,
    session: SessionDep,
    settings: SettingsDep,
    organizer: Organizer,
    csrf: CsrfField = None,
    uses: Annotated[str, Form()] = "",
    expires_hours: Annotated[str, Form()] = "",
    label: Annotated[str, Form()] = "",
) -> Response:
    check_csrf(request, csrf)
    require_organizer(organizer)
    run = _run(session, run_id)
    try:
        body = TokenCreate(
            max_uses=int(uses) if uses.strip() else None,
            expires_in_s=float(expires_hours) * 3600 if expires_hours.strip() else None,
            label=label.strip() or None,
        )
    except ValueError:
        raise PageError(
            422, "Uses must be a whole number of at least 1 and hours a positive number."
        ) from None
    _, plaintext = token_service.create_join_token(
        session,
        run,
        body,
        settings.join_token_default_ttl_s,
        settings.join_token_default_max_uses,
    )
    session.commit()
    # The new link is shown once, on the page this redirects to; it is a secret in the URL of
    # the organizer's own browser only (the access log redacts /join/ paths, not this one).
    return RedirectResponse(
        f"/runs/{run.id}?invite={quote(plaintext)}#invite-link", status_code=303
    )


@router.post("/runs/{run_id}/invites/{token_id}/revoke")
def revoke_invite(
    request: Request,
    run_id: str,
    token_id: str,
    session: SessionDep,
    organizer: Organizer,
    csrf: CsrfField = None,
) -> Response:
    check_csrf(request, csrf)
    require_organizer(organizer)
    run = _run(session, run_id)
    token = token_service.get_join_token(session, run, token_id[:32])
    if token is None:
        raise PageError(404, "This run has no such invite.")
    token_service.revoke(session, token)
    session.commit()
    return RedirectResponse(f"/runs/{run.id}#invites", status_code=303)


@router.post("/runs/{run_id}/volunteers/{volunteer_id}/ban")
def ban_volunteer(
    request: Request,
    run_id: str,
    volunteer_id: int,
    session: SessionDep,
    organizer: Organizer,
    csrf: CsrfField = None,
) -> Response:
    check_csrf(request, csrf)
    require_organizer(organizer)
    run = _run(session, run_id)
    if not 1 <= volunteer_id <= dashboard_service.MAX_ID:
        raise PageError(404, "This run has no such volunteer.")
    try:
        volunteer_service.ban(session, run, volunteer_id)
    except NotFound:
        raise PageError(404, "This run has no such volunteer.") from None
    session.commit()
    return RedirectResponse(f"/runs/{run.id}#volunteers", status_code=303)


@router.get("/runs/{run_id}/checkpoint.pt")
def download_checkpoint(
    request: Request, run_id: str, session: SessionDep, organizer: Organizer
) -> Response:
    require_organizer(organizer)
    run = _run(session, run_id)
    try:
        checkpoint, path = checkpoint_service.newest_file(
            session, request.app.state.checkpoint_store, run.id
        )
    except NotFound:
        raise PageError(404, "This run has no checkpoint yet.") from None
    return FileResponse(
        path,
        media_type="application/octet-stream",
        filename=f"{run.name}-epoch{checkpoint.epoch}.pt",
    )


# ----------------------------------------------------------------------------- helpers


def _run(session: SessionDep, run_id: str) -> Any:
    try:
        return run_service.get_run(session, run_id[:32])
    except NotFound:
        raise PageError(404, "There is no such run.") from None


def _next(request: Request) -> str:
    return _safe_next(request.query_params.get("next", "/"))


def _safe_next(value: str) -> str:
    """Only a path on this site: never an open redirect."""
    if not value.startswith("/") or value.startswith("//") or "\\" in value:
        return "/"
    return value


def page_error_handler(request: Request, exc: Exception) -> HTMLResponse:
    assert isinstance(exc, PageError)
    return render(
        request, "error.html", {"message": exc.message, "status": exc.status}, status=exc.status
    )
