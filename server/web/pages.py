"""The pages: runs list, run dashboard, volunteer page, invite page, organizer sign-in, and the
organizer's forms. Server-rendered with the current numbers (they work without JavaScript);
the scripts in ``web/static/js`` then keep them live over the WebSockets of
``server.api.routes.dashboard``.

Every form carries the CSRF token of :mod:`server.web.security`; every POST checks it first.
Organizer forms answer with a redirect back to the page (POST/redirect/GET), carrying what
happened in the query string only when it is no secret."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Annotated, Any
from urllib.parse import quote

from fastapi import APIRouter, Depends, Form, Request
from fastapi.exception_handlers import http_exception_handler
from fastapi.responses import FileResponse, HTMLResponse, RedirectResponse, Response
from fastapi.templating import Jinja2Templates
from starlette.exceptions import HTTPException as StarletteHTTPException

from server.api.deps import SessionDep, SettingsDep
from server.config import Settings
from server.exceptions import CoordinatorError, NotFound, Unauthenticated
from server.models import RunStatus, TokenScope, Volunteer
from server.schemas import RunUpdate, TokenCreate
from server.security import parse_token
from server.services import checkpoints as checkpoint_service
from server.services import dashboard as dashboard_service
from server.services import runs as run_service
from server.services import tokens as token_service
from server.services import volunteer_table
from server.services import volunteers as volunteer_service
from server.web import formatting
from server.web.credential_cookie import (
    KEEP_S,
    CredentialSeal,
    KeptCredential,
    cookie_name,
    cookie_path,
)
from server.web.security import (
    CSRF_FIELD,
    ORGANIZER_COOKIE,
    csrf_cookie_name,
    csrf_matches,
    csrf_session,
    csrf_token,
    is_page,
    new_session,
)


def _web_dir() -> Path:
    """Installed: the data package ``server.web.assets``; in the repository: ``web/``."""
    installed = Path(__file__).resolve().parent / "assets"
    if (installed / "templates").is_dir():
        return installed
    return Path(__file__).resolve().parents[2] / "web"


WEB_DIR = _web_dir()
templates = Jinja2Templates(directory=WEB_DIR / "templates")
formatting.install(templates.env)

router = APIRouter(include_in_schema=False)


TITLES = {
    403: "Not allowed",
    404: "Not found",
    409: "Not possible now",
    410: "No longer available",
    422: "Check what you entered",
}


class PageError(Exception):
    """Rendered as the error page with ``status``, a plain heading (``title``, else one for
    the status) and ``message``."""

    def __init__(self, status: int, message: str, title: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.title = title or TITLES.get(status, "Something went wrong")


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
    """A template with the CSRF token of the browser's session (an anonymous session's
    cookie is set if the browser has none)."""
    settings: Settings = request.app.state.settings
    secure = _secure(settings)
    session = csrf_session(request.cookies, secure)
    fresh = session is None
    if session is None:
        session = new_session()
    csrf = csrf_token(settings.secret_keys()[0], session)
    response = templates.TemplateResponse(
        request,
        name,
        {
            **context,
            "csrf": csrf,
            "csrf_field": CSRF_FIELD,
            "signed_in": organizer is not None,
            "now": datetime.now(UTC),
        },
        status_code=status,
    )
    if fresh:
        response.set_cookie(
            csrf_cookie_name(secure), session, httponly=True, samesite="strict", secure=secure
        )
    return response


def check_csrf(request: Request, field: str | None) -> None:
    settings: Settings = request.app.state.settings
    session = csrf_session(request.cookies, _secure(settings))
    if not csrf_matches(settings.secret_keys(), session, field):
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
        view=volunteer_table.view_from_query(request.query_params),
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
        ban_offer = _ban_offer(session, run, request.query_params.get("banned", ""))
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
        secure=_secure(settings),
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


@dataclass(frozen=True, slots=True)
class Action:
    status: RunStatus
    allowed_from: frozenset[RunStatus]
    done: str


ACTIONS = {
    "pause": Action(RunStatus.paused, frozenset({RunStatus.running}), "paused"),
    "resume": Action(RunStatus.running, frozenset({RunStatus.paused}), "resumed"),
    "finish": Action(
        RunStatus.finished, frozenset({RunStatus.running, RunStatus.paused}), "finished"
    ),
}


@router.get("/runs/{run_id}/finish", response_class=HTMLResponse)
def finish_page(
    request: Request, run_id: str, session: SessionDep, organizer: Organizer
) -> HTMLResponse:
    """Finishing cannot be undone: the organizer confirms it on this page first."""
    require_organizer(organizer)
    run = _run(session, run_id)
    if run.status not in ACTIONS["finish"].allowed_from:
        raise PageError(409, f"The run is {run.status.value}: it cannot be finished.")
    return render(request, "finish.html", {"run": run}, organizer=organizer)


@router.post("/runs/{run_id}/actions/{action}")
def run_action(
    request: Request,
    run_id: str,
    action: str,
    session: SessionDep,
    organizer: Organizer,
    csrf: CsrfField = None,
    confirm: Annotated[str, Form()] = "",
) -> Response:
    check_csrf(request, csrf)
    require_organizer(organizer)
    if action not in ACTIONS:
        raise PageError(404, "There is no such action.")
    run = _run(session, run_id)
    if run.status not in ACTIONS[action].allowed_from:
        raise PageError(409, f"The run is {run.status.value}: it cannot be {ACTIONS[action].done}.")
    if action == "finish" and confirm != "yes":  # only from the confirmation page
        return RedirectResponse(f"/runs/{run.id}/finish", status_code=303)
    try:
        run_service.update_run(session, run, RunUpdate(status=ACTIONS[action].status))
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
    # The run page then offers to revoke the invites the volunteer came through.
    return RedirectResponse(f"/runs/{run.id}?banned={volunteer_id}#ban-offer", status_code=303)


@dataclass(frozen=True)
class BanOffer:
    volunteer: Volunteer
    invites: list[Any]  # the unrevoked invites it came through


def _ban_offer(session: SessionDep, run: Any, banned: str) -> BanOffer | None:
    if not banned.isdigit() or not 1 <= int(banned) <= dashboard_service.MAX_ID:
        return None
    try:
        volunteer = volunteer_service.get_volunteer(session, run, int(banned))
    except NotFound:
        return None
    if volunteer.banned_at is None:
        return None
    invites = [
        t for t in volunteer_service.invites_used(session, volunteer) if t.revoked_at is None
    ]
    return BanOffer(volunteer, invites)


@router.post("/runs/{run_id}/checkpoints/{epoch}/{action}")
def checkpoint_action(
    request: Request,
    run_id: str,
    epoch: int,
    action: str,
    session: SessionDep,
    organizer: Organizer,
    csrf: CsrfField = None,
) -> Response:
    """Pin, unpin or delete one of the run's checkpoints."""
    check_csrf(request, csrf)
    require_organizer(organizer)
    run = _run(session, run_id)
    try:
        if action == "pin":
            checkpoint_service.pin(session, run.id, epoch)
            session.commit()
        elif action == "unpin":
            checkpoint_service.unpin(session, run.id)
            session.commit()
        elif action == "delete":
            checkpoint_service.delete_checkpoint(
                session, request.app.state.checkpoint_store, run.id, epoch
            )
        else:
            raise PageError(404, "No such action on a checkpoint.")
    except NotFound as exc:
        raise PageError(404, str(exc)) from None
    return RedirectResponse(f"/runs/{run.id}#checkpoints", status_code=303)


@router.get("/runs/{run_id}/checkpoint.pt")
def download_checkpoint(
    request: Request, run_id: str, session: SessionDep, organizer: Organizer
) -> Response:
    require_organizer(organizer)
    run = _run(session, run_id)
    try:
        checkpoint, path = checkpoint_service.served_file(
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
        raise PageError(
            404, "There is no run with this id. It may have been deleted.", title="No such run"
        ) from None


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
        request,
        "error.html",
        {"message": exc.message, "status": exc.status, "title": exc.title},
        status=exc.status,
    )


def wants_html(request: Request) -> bool:
    """A browser asking for a page (not the API, not a script asking for JSON)."""
    accept = request.headers.get("accept", "")
    return is_page(request.url.path) and "text/html" in accept


async def not_found_handler(request: Request, exc: Exception) -> Response:
    """Unknown paths: the error page for a browser, JSON for the API and other clients."""
    assert isinstance(exc, StarletteHTTPException)
    if exc.status_code == 404 and wants_html(request):
        return page_error_handler(
            request, PageError(404, "There is no page at this address.", title="Page not found")
        )
    return await http_exception_handler(request, exc)
