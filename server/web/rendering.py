"""What every page shares: the templates, the error page (:class:`PageError`, and the
handlers that render it), the signed-in organizer, the CSRF check of every form, and the
look-up of the run a page is about."""

from __future__ import annotations

from collections.abc import Mapping
from datetime import UTC, datetime
from pathlib import Path
from typing import Annotated

from fastapi import Depends, Form, Request
from fastapi.exception_handlers import http_exception_handler
from fastapi.responses import HTMLResponse, Response
from fastapi.templating import Jinja2Templates
from starlette.exceptions import HTTPException as StarletteHTTPException

from server.api.deps import SessionDep, SettingsDep
from server.config import Settings
from server.exceptions import NotFound, Unauthenticated
from server.models import Run, TokenScope
from server.services import runs as run_service
from server.services import tokens as token_service
from server.web import formatting
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


def secure_cookies(settings: Settings) -> bool:
    """Whether cookies are marked Secure: the coordinator is served over https."""
    return settings.public_url.startswith("https://")


def render(
    request: Request,
    name: str,
    context: Mapping[str, object],
    *,
    status: int = 200,
    organizer: str | None = None,
) -> HTMLResponse:
    """A template with the CSRF token of the browser's session (an anonymous session's
    cookie is set if the browser has none)."""
    settings: Settings = request.app.state.settings
    secure = secure_cookies(settings)
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
    session = csrf_session(request.cookies, secure_cookies(settings))
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


def find_run(session: SessionDep, run_id: str) -> Run:
    """The run ``run_id`` names, or the error page that says there is none."""
    try:
        return run_service.get_run(session, run_id[:32])
    except NotFound:
        raise PageError(
            404, "There is no run with this id. It may have been deleted.", title="No such run"
        ) from None


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
