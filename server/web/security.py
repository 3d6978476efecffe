"""What keeps the pages safe: security headers, the organizer's sign-in cookie, CSRF tokens,
and invite tokens kept out of the access log.

- **Headers.** A Content-Security-Policy allowing this origin only (no inline script or
  style), no framing, ``nosniff``, ``no-referrer`` and ``Cache-Control: no-store``.
- **Organizer cookie.** The organizer token itself, HttpOnly, SameSite=Strict (Secure over
  https), checked against the database on each request.
- **CSRF.** Every form carries a ``csrf`` field: an HMAC, with the secret key, of the
  browser's session (the organizer cookie, else a random value in an HttpOnly,
  SameSite=Strict cookie, ``__Host-`` prefixed over https). A POST whose field is not the
  HMAC of the session it arrives with is refused.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import re
import secrets
from collections.abc import Iterable, Mapping

from starlette.types import ASGIApp, Message, Receive, Scope, Send

ORGANIZER_COOKIE = "swarmgrad_organizer"
CSRF_COOKIE = "swarmgrad_csrf"
CSRF_FIELD = "csrf"
_CSRF_CONTEXT = b"swarmgrad/csrf/v1\x00"

CONTENT_SECURITY_POLICY = (
    "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
    "connect-src 'self'; frame-ancestors 'none'; base-uri 'none'; form-action 'self'"
)
PAGE_HEADERS = [
    (b"content-security-policy", CONTENT_SECURITY_POLICY.encode()),
    (b"x-content-type-options", b"nosniff"),
    (b"referrer-policy", b"no-referrer"),
    (b"x-frame-options", b"DENY"),
    (b"cross-origin-opener-policy", b"same-origin"),
]
NO_STORE = (b"cache-control", b"no-store")


def is_page(path: str) -> bool:
    """Paths served as HTML pages (everything but the API, static files and probes)."""
    return not path.startswith(("/api/", "/static/", "/healthz", "/metrics", "/docs", "/openapi"))


class PageHeaders:
    """Adds :data:`PAGE_HEADERS` (and ``no-store``) to every page answer, ``nosniff`` and the
    CSP to static files too."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path: str = scope["path"]
        page = is_page(path)
        static = path.startswith("/static/")
        if not (page or static):
            await self.app(scope, receive, send)
            return

        async def send_with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = [
                    (k, v)
                    for k, v in message.get("headers", ())
                    if k.lower() not in {h for h, _ in PAGE_HEADERS}
                ]
                headers.extend(PAGE_HEADERS)
                if page:
                    headers = [(k, v) for k, v in headers if k.lower() != b"cache-control"]
                    headers.append(NO_STORE)
                message = {**message, "headers": headers}
            await send(message)

        await self.app(scope, receive, send_with_headers)


def csrf_cookie_name(secure: bool) -> str:
    """The anonymous session's cookie: ``__Host-`` prefixed over https (the browser then
    takes it only Secure, for path ``/`` and this host alone)."""
    return f"__Host-{CSRF_COOKIE}" if secure else CSRF_COOKIE


def new_session() -> str:
    """A fresh anonymous session, for the cookie :func:`csrf_cookie_name` names."""
    return secrets.token_urlsafe(24)


def csrf_session(cookies: Mapping[str, str], secure: bool) -> str | None:
    """The session a form is bound to: the organizer cookie once signed in, else the
    anonymous session cookie (None: the browser has neither yet)."""
    return cookies.get(ORGANIZER_COOKIE) or cookies.get(csrf_cookie_name(secure)) or None


def csrf_token(secret: str, session: str) -> str:
    """The form field for ``session``: an HMAC of it with the coordinator's secret key."""
    mac = hmac.new(secret.encode(), _CSRF_CONTEXT + session.encode(), hashlib.sha256)
    return mac.hexdigest()


def csrf_matches(secrets_: Iterable[str | None], session: str | None, field: str | None) -> bool:
    """Whether ``field`` is :func:`csrf_token` of ``session`` under one of the keys (the
    current secret key, and the previous one during a rotation)."""
    if not session or not field:
        return False
    return any(
        hmac.compare_digest(csrf_token(secret, session).encode(), field.encode())
        for secret in secrets_
        if secret
    )


_INVITE_PATH = re.compile(r"(/join/)[^/?\s\"]+")


def redact_invites(text: str) -> str:
    """``/join/<token>`` becomes ``/join/<redacted>``."""
    return _INVITE_PATH.sub(r"\1<redacted>", text)


class RedactInvites(logging.Filter):
    """Keeps invite tokens (which are in the invite page's URL) out of uvicorn's access log:
    its records carry the path among their arguments."""

    def filter(self, record: logging.LogRecord) -> bool:
        if isinstance(record.args, tuple):
            record.args = tuple(redact_invites(a) if isinstance(a, str) else a for a in record.args)
        elif isinstance(record.msg, str):
            record.msg = redact_invites(record.msg)
        return True


def install_log_redaction() -> None:
    """Idempotent: add :class:`RedactInvites` to uvicorn's access logger."""
    access = logging.getLogger("uvicorn.access")
    if not any(isinstance(f, RedactInvites) for f in access.filters):
        access.addFilter(RedactInvites())
