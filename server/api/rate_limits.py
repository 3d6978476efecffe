"""Rate limits at the door: an ASGI middleware that answers 429 before any routing, token
check or body read, for the endpoints a volunteer calls (:class:`Endpoint`).

The client address is ``scope["client"]``: the socket's peer, or what ``X-Forwarded-For``
says when that peer is one of ``trusted_proxies`` (the app resolves it first, with
uvicorn's ``ProxyHeadersMiddleware``; see :func:`server.app.create_app`). The per-token key
is a hash of the whole bearer token, not its id, so nobody can empty another peer's bucket
without its secret; refusals of reports by a peer's own bucket are counted against that peer
when this worker knows its token (the peer auth cache), like the plausibility bounds' 422s.
"""

from __future__ import annotations

import hashlib
import re
import time
from collections.abc import Callable
from types import SimpleNamespace

from fastapi.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from server.api import API_PREFIX
from server.clock import now_ms
from server.config import Settings
from server.metrics import Metrics
from server.security import parse_token
from server.services.rate_limits import (
    Endpoint,
    RateLimit,
    RateLimiter,
    Refusal,
)
from server.services.tokens import Principal

_RUN = rf"^{re.escape(API_PREFIX)}/runs/([^/]{{1,32}})/"
_ROUTES: list[tuple[str, re.Pattern[str], Endpoint, str]] = [
    ("POST", re.compile(rf"^{re.escape(API_PREFIX)}/join/challenge$"), Endpoint.JOIN_CHALLENGE,
     f"{API_PREFIX}/join/challenge"),
    ("POST", re.compile(_RUN + "join$"), Endpoint.JOIN, f"{API_PREFIX}/runs/{{run_id}}/join"),
    ("POST", re.compile(_RUN + "reports$"), Endpoint.REPORTS,
     f"{API_PREFIX}/runs/{{run_id}}/reports"),
    ("GET", re.compile(_RUN + "bootstrap$"), Endpoint.BOOTSTRAP,
     f"{API_PREFIX}/runs/{{run_id}}/bootstrap"),
    # the rendezvous list is asked for beside bootstrap, and counts with it
    ("GET", re.compile(_RUN + "rendezvous$"), Endpoint.BOOTSTRAP,
     f"{API_PREFIX}/runs/{{run_id}}/rendezvous"),
    ("POST", re.compile(_RUN + "certificate$"), Endpoint.CERTIFICATE,
     f"{API_PREFIX}/runs/{{run_id}}/certificate"),
    ("POST", re.compile(_RUN + "leave$"), Endpoint.LEAVE, f"{API_PREFIX}/runs/{{run_id}}/leave"),
    # The dashboard's data and pages: anyone may read them, and a page of the volunteers'
    # table, a volunteer's page or an HTML page is built for its request.
    ("GET", re.compile(rf"^{re.escape(API_PREFIX)}/dashboard$"), Endpoint.DASHBOARD,
     f"{API_PREFIX}/dashboard"),
    ("GET", re.compile(_RUN + "dashboard$"), Endpoint.DASHBOARD,
     f"{API_PREFIX}/runs/{{run_id}}/dashboard"),
    ("GET", re.compile(_RUN + "volunteers$"), Endpoint.DASHBOARD,
     f"{API_PREFIX}/runs/{{run_id}}/volunteers"),
    ("GET", re.compile(_RUN + "volunteers/[^/]+$"), Endpoint.DASHBOARD,
     f"{API_PREFIX}/runs/{{run_id}}/volunteers/{{ref}}"),
    ("GET", re.compile(r"^/$"), Endpoint.DASHBOARD, "/"),
    ("GET", re.compile(r"^/runs/([^/]{1,32})$"), Endpoint.DASHBOARD, "/runs/{run_id}"),
    ("GET", re.compile(r"^/runs/([^/]{1,32})/volunteers/[^/]+$"), Endpoint.DASHBOARD,
     "/runs/{run_id}/volunteers/{ref}"),
]  # fmt: skip
_WHAT = {
    Endpoint.JOIN_CHALLENGE: "join challenges",
    Endpoint.JOIN: "joins",
    Endpoint.REPORTS: "progress reports",
    Endpoint.BOOTSTRAP: "bootstrap requests",
    Endpoint.CERTIFICATE: "certificate renewals",
    Endpoint.LEAVE: "leaves",
    Endpoint.DASHBOARD: "dashboard requests",
}


def limiter_from_settings(settings: Settings) -> RateLimiter:
    """The limits ``settings`` configure: joins and dashboard reads per address; reports,
    bootstrap and certificate renewal and leaving per peer token and per address."""
    join = RateLimit(settings.rate_limit_join_per_s, settings.rate_limit_join_burst)
    reports = RateLimit(settings.rate_limit_reports_per_s, settings.rate_limit_reports_burst)
    peer = RateLimit(settings.rate_limit_peer_per_s, settings.rate_limit_peer_burst)
    address = RateLimit(settings.rate_limit_address_per_s, settings.rate_limit_address_burst)
    dashboard = RateLimit(settings.rate_limit_dashboard_per_s, settings.rate_limit_dashboard_burst)
    return RateLimiter(
        per_peer={
            Endpoint.REPORTS: reports,
            Endpoint.BOOTSTRAP: peer,
            Endpoint.CERTIFICATE: peer,
            Endpoint.LEAVE: peer,
        },
        per_address={
            Endpoint.JOIN_CHALLENGE: join,
            Endpoint.JOIN: join,
            Endpoint.REPORTS: address,
            Endpoint.BOOTSTRAP: address,
            Endpoint.CERTIFICATE: address,
            Endpoint.LEAVE: address,
            Endpoint.DASHBOARD: dashboard,
        },
        max_keys=settings.rate_limit_max_keys,
        ipv6_prefix=settings.rate_limit_ipv6_prefix,
    )


class RateLimitMiddleware:
    """429 with ``Retry-After`` and a JSON ``detail`` for requests over a limit."""

    def __init__(
        self,
        app: ASGIApp,
        limiter: RateLimiter,
        metrics: Metrics,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.app = app
        self.limiter = limiter
        self.metrics = metrics
        self.clock = clock

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        matched = _match(scope["method"], scope["path"])
        if matched is None:
            await self.app(scope, receive, send)
            return
        endpoint, template, run_id = matched
        client = scope.get("client")
        address = self.limiter.address(client[0] if client else None)
        if address is None:  # loopback: exempt
            await self.app(scope, receive, send)
            return
        token = _bearer(scope) if self.limiter.limits_peers(endpoint) else None
        peer = hashlib.blake2b(token.encode("latin-1"), digest_size=16).digest() if token else None
        refusal = self.limiter.check(endpoint, address, peer, self.clock())
        if refusal is None:
            await self.app(scope, receive, send)
            return
        self.metrics.count_rate_limited(endpoint.value, refusal.by)
        if refusal.by == "peer" and endpoint is Endpoint.REPORTS and token and run_id:
            _count_against_peer(scope, token, run_id, refusal)
        scope["route"] = SimpleNamespace(path=template)  # the metrics label
        who = "this peer" if refusal.by == "peer" else "this address"
        response = JSONResponse(
            {
                "detail": f"too many {_WHAT[endpoint]} from {who}; "
                f"try again in {refusal.retry_after_header} s"
            },
            status_code=429,
            headers={"Retry-After": refusal.retry_after_header},
        )
        await response(scope, receive, send)


def _match(method: str, path: str) -> tuple[Endpoint, str, str | None] | None:
    for route_method, pattern, endpoint, template in _ROUTES:
        if method == route_method:
            found = pattern.match(path)
            if found is not None:
                return endpoint, template, found.group(1) if found.groups() else None
    return None


def _bearer(scope: Scope) -> str | None:
    for name, value in scope["headers"]:
        if name == b"authorization" and value[:7].lower() == b"bearer ":
            return value[7:].decode("latin-1").strip() or None
    return None


def _count_against_peer(scope: Scope, token: str, run_id: str, refusal: Refusal) -> None:
    """Record the refusal in the peer's ``reports_refused``/``last_refusal`` if this worker
    verified its token recently (no database round trip for a refused request)."""
    app_state = scope["app"].state
    buffer = getattr(app_state, "report_buffer", None)
    parsed = parse_token(token)
    if buffer is None or parsed is None:
        return
    cached = app_state.principal_cache.get(parsed.id, parsed.secret)
    if isinstance(cached, Principal) and cached.run_id == run_id and cached.peer_pk is not None:
        buffer.count_refusal(cached.peer_pk, refusal.reason, now_ms())
