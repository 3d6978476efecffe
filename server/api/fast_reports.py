"""A fast path for the most frequent request, ``POST /api/v1/runs/{run_id}/reports``.

FastAPI's routing and dependency resolution cost more CPU than everything the report route
does. This middleware answers the common case — JSON body, a peer token this worker verified
within ``peer_auth_cache_ttl_s`` for this very run, a body that validates and passes the
plausibility bounds with what the worker already knows — directly, with the same schema
(:class:`~peer.formats.requests.ReportCreate`) and answer as the route, through the same
function (:func:`~server.services.report_guard.take_report`).
Everything else (cache misses, invalid bodies, other content types, errors of any kind) is
passed on untouched to the FastAPI route, which stays the reference implementation and
produces every error message; so the fast path can only ever take requests the route would
have accepted.
"""

from __future__ import annotations

import re
from types import SimpleNamespace

from pydantic import ValidationError
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from server.api import API_PREFIX
from server.models import TokenScope
from server.schemas import ReportAccepted, ReportCreate
from server.security import parse_token
from server.services.report_guard import take_report
from server.services.tokens import Principal

_PATH = re.compile(rf"^{re.escape(API_PREFIX)}/runs/([^/]{{1,32}})/reports$")
_ROUTE = SimpleNamespace(path=f"{API_PREFIX}/runs/{{run_id}}/reports")  # the metrics label
_MAX_FAST_BODY = 4096
_ACCEPTED_BODY = ReportAccepted().model_dump_json().encode()
_ACCEPTED_HEADERS = [
    (b"content-type", b"application/json"),
    (b"content-length", str(len(_ACCEPTED_BODY)).encode()),
]


class ReportFastPath:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] != "POST":
            await self.app(scope, receive, send)
            return
        match = _PATH.match(scope["path"])
        principal = self._cached_principal(scope, match.group(1)) if match else None
        if principal is None:
            await self.app(scope, receive, send)
            return
        # Read the (small) body; if anything is off, replay it to the route.
        messages: list[Message] = []
        body = b""
        while True:
            message = await receive()
            messages.append(message)
            if message["type"] != "http.request":
                break
            body += message.get("body", b"")
            if len(body) > _MAX_FAST_BODY or not message.get("more_body", False):
                break
        buffer = getattr(scope["app"].state, "report_buffer", None)
        report = None
        if (
            buffer is not None
            and messages[-1]["type"] == "http.request"
            and not messages[-1].get("more_body")
        ):
            try:
                report = ReportCreate.model_validate_json(body)
            except ValidationError:
                report = None
        taken = False
        if report is not None and buffer is not None:
            assert principal.run_id is not None and principal.peer_pk is not None
            guard = scope["app"].state.report_guard
            taken = await take_report(
                guard, buffer, principal.run_id, principal.peer_pk, report, at_hand=True
            )
        if not taken:  # the route answers it
            await self.app(scope, _replay(messages, receive), send)
            return
        scope["route"] = _ROUTE
        await send({"type": "http.response.start", "status": 202, "headers": _ACCEPTED_HEADERS})
        await send({"type": "http.response.body", "body": _ACCEPTED_BODY})

    @staticmethod
    def _cached_principal(scope: Scope, run_id: str) -> Principal | None:
        authorization = content_type = None
        length = -1
        for name, value in scope["headers"]:
            if name == b"authorization":
                authorization = value
            elif name == b"content-type":
                content_type = value
            elif name == b"content-length" and value.isdigit():
                length = int(value)
        if (
            content_type != b"application/json"
            or not 0 < length <= _MAX_FAST_BODY
            or authorization is None
            or not authorization.startswith(b"Bearer ")
        ):
            return None
        parsed = parse_token(authorization[7:].decode("latin-1"))
        if parsed is None or parsed.scope is not TokenScope.peer:
            return None
        cached = scope["app"].state.principal_cache.get(parsed.id, parsed.secret)
        if isinstance(cached, Principal) and cached.run_id == run_id:
            return cached
        return None


def _replay(messages: list[Message], receive: Receive) -> Receive:
    pending = list(messages)

    async def replayed() -> Message:
        if pending:
            return pending.pop(0)
        return await receive()

    return replayed
