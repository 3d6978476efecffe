"""A connection to one coordinator over HTTP: what every call of
:class:`~peer.coordinator.client.CoordinatorClient` goes through.

One synchronous ``httpx.Client`` underneath (safe to share between threads). Every answer
must carry the ``X-Swarmgrad-Coordinator`` header, so that a captive portal or another
service at the URL is reported as such instead of as a puzzling error; an answer is parsed
into its type of :mod:`peer.formats.payloads` before a field is read, and one of another
shape is :class:`~peer.coordinator.exceptions.NotACoordinator`, naming the field. Every
failure is a :class:`~peer.coordinator.exceptions.CoordinatorError` with a one-line message;
httpx's own errors never escape.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import NoReturn, Self, TypeVar
from urllib.parse import quote, urlsplit, urlunsplit

import httpx
from pydantic import BaseModel, ValidationError

from peer.coordinator.exceptions import CoordinatorFailed, CoordinatorUnreachable, NotACoordinator
from peer.coordinator.responses import error_from, reason
from peer.formats.open_types import JsonObject

API_PREFIX = "/api/v1"
COORDINATOR_HEADER = "X-Swarmgrad-Coordinator"

_M = TypeVar("_M", bound=BaseModel)
# A query's parameters, as httpx takes them.
Params = Mapping[str, str | int]

_GATEWAY_DOWN = frozenset({502, 503, 504})
#: how long an idle connection is kept for the next request: well under the coordinator's idle
#: timeout (``http_keep_alive_s``, 5 s by default), so a request is not sent on a connection
#: the server is closing at that moment
KEEPALIVE_EXPIRY_S = 2.0
# Requests sent again, once, on a fresh connection when the server closed the one they went out
# on without answering (a kept-alive connection it timed out): the others may have been acted on.
_IDEMPOTENT = frozenset({"GET", "HEAD", "PUT", "DELETE", "OPTIONS"})
_TOKEN_CHARS = re.compile(r"^[\x21-\x7e]+$")  # printable ASCII, no spaces


class CoordinatorConnection:
    """HTTP to the coordinator at ``url`` (``http://host:port`` or ``https://...``, with a
    path prefix if it sits behind one): requests with a token, their failures as
    :class:`~peer.coordinator.exceptions.CoordinatorError`, answers parsed into payloads.

    ``timeout`` bounds each network operation (connect, each read and write), not a whole
    transfer. ``transport`` replaces the network (``httpx.MockTransport`` in tests). Use as a
    context manager or call :meth:`close`.
    """

    def __init__(
        self,
        url: str,
        *,
        timeout: float = 10.0,
        transport: httpx.BaseTransport | None = None,
    ) -> None:
        self.url, self.host = _parse_url(url)
        if not timeout > 0:
            raise ValueError("timeout must be > 0 seconds")
        self.timeout = float(timeout)
        self._http = httpx.Client(
            base_url=self.url,
            timeout=self.timeout,
            transport=transport,
            follow_redirects=False,
            headers={"User-Agent": "swarmgrad-peer"},
            limits=httpx.Limits(keepalive_expiry=KEEPALIVE_EXPIRY_S),
        )

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _parse(self, model: type[_M], body: JsonObject) -> _M:
        """``body`` as the payload type both sides share (:mod:`peer.formats.payloads`); an
        answer of another shape is not a coordinator of this version, said with its field."""
        try:
            return model.model_validate(body)
        except ValidationError as exc:
            first = exc.errors()[0]
            where = ".".join(str(part) for part in first["loc"]) or "body"
            what = f"no {where!r}" if first["type"] == "missing" else f"a malformed {where!r}"
            raise NotACoordinator(
                f"{self.host} sent an answer with {what}; it is not a Swarmgrad coordinator "
                "of this version"
            ) from exc

    def _json(
        self,
        method: str,
        path: str,
        *,
        token: str | None = None,
        body: BaseModel | None = None,
        content: bytes | None = None,
        params: Params | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> JsonObject:
        """The JSON object the coordinator answers (:meth:`_request`'s arguments)."""
        response = self._request(
            method, path, token=token, body=body, content=content, params=params, headers=headers
        )
        try:
            answer = response.json()
        except ValueError as exc:
            raise NotACoordinator(
                f"{self.host} answered but is not a Swarmgrad coordinator (the answer is not JSON)",
                status_code=response.status_code,
            ) from exc
        if not isinstance(answer, dict):
            raise NotACoordinator(
                f"{self.host} answered but is not a Swarmgrad coordinator "
                "(the answer is not a JSON object)",
                status_code=response.status_code,
            )
        return answer

    def _request(
        self,
        method: str,
        path: str,
        *,
        token: str | None = None,
        body: BaseModel | None = None,
        content: bytes | None = None,
        params: Params | None = None,
        headers: Mapping[str, str] | None = None,
        timeout: float | None = None,
    ) -> httpx.Response:
        """The coordinator's answer to ``method path``, sent with ``token``, and ``body`` (a
        request of :mod:`peer.formats.requests`: the fields it was given, as JSON) or
        ``content``; a :class:`~peer.coordinator.exceptions.CoordinatorError` for a refusal
        or a failure."""
        all_headers = dict(headers or {})
        if token is not None:
            all_headers["Authorization"] = f"Bearer {check_token(token)}"
        if body is not None:
            # python's values, not pydantic's JSON mode, which sends a NaN as null
            content = _json_bytes(body.model_dump(exclude_unset=True))
            all_headers["Content-Type"] = "application/json"

        def send() -> httpx.Response:
            return self._http.request(
                method,
                path,
                content=content,
                params=params,
                headers=all_headers,
                timeout=self.timeout if timeout is None else timeout,
            )

        try:
            try:
                response = send()
            except httpx.RemoteProtocolError:
                if method.upper() not in _IDEMPOTENT:
                    raise
                response = send()
        except httpx.TimeoutException as exc:
            limit = self.timeout if timeout is None else timeout
            raise CoordinatorUnreachable(
                f"the coordinator at {self.host} did not answer within {limit:g} s"
            ) from exc
        except httpx.ConnectError as exc:
            raise CoordinatorUnreachable(
                f"cannot reach the coordinator at {self.host}: {reason(exc)}"
            ) from exc
        except httpx.TransportError as exc:
            raise CoordinatorUnreachable(
                f"lost the connection to the coordinator at {self.host}: {reason(exc)}"
            ) from exc
        if response.headers.get(COORDINATOR_HEADER) != "1":
            self._not_a_coordinator(response)
        if response.status_code >= 400:
            raise error_from(response)
        if response.status_code >= 300:
            raise CoordinatorFailed(
                f"the coordinator at {self.host} answered HTTP {response.status_code} "
                "where it never redirects",
                status_code=response.status_code,
            )
        return response

    def _not_a_coordinator(self, response: httpx.Response) -> NoReturn:
        code = response.status_code
        if code in _GATEWAY_DOWN:
            # A reverse proxy in front of a coordinator that is down or restarting.
            raise CoordinatorUnreachable(
                f"{self.host} answered {code} {response.reason_phrase}: "
                "the coordinator behind it is not answering",
                status_code=code,
            )
        raise NotACoordinator(
            f"{self.host} answered but is not a Swarmgrad coordinator (HTTP {code}); check the URL",
            status_code=code,
        )


def _parse_url(url: str) -> tuple[str, str]:
    """The base URL without credentials, query or fragment, and ``host[:port]`` to name in
    messages."""
    if not isinstance(url, str):
        raise TypeError("the coordinator URL is a string, e.g. 'http://127.0.0.1:8000'")
    parts = urlsplit(url.strip())
    if parts.scheme not in ("http", "https"):
        raise ValueError(
            "the coordinator URL must start with http:// or https:// (e.g. http://host:8000)"
        )
    try:
        hostname, port = parts.hostname, parts.port
    except ValueError as exc:
        raise ValueError("the coordinator URL has an invalid port") from exc
    if not hostname:
        raise ValueError("the coordinator URL names no host (e.g. http://host:8000)")
    host = f"[{hostname}]" if ":" in hostname else hostname
    shown = host if port is None else f"{host}:{port}"
    base = urlunsplit((parts.scheme, shown, parts.path.rstrip("/"), "", ""))
    return base, shown


def check_token(token: str) -> str:
    """``token`` without surrounding blanks; ``ValueError`` (never echoing it) if it
    cannot be a token."""
    if not isinstance(token, str) or not token.strip():
        raise ValueError("a token is needed (the text after --token)")
    token = token.strip()
    if not _TOKEN_CHARS.match(token):
        raise ValueError("the token holds characters no token has; copy it again")
    return token


def run_path(run_id: str, *rest: str) -> str:
    """The path of a run's resource: ``/api/v1/runs/<run_id>/<rest...>``, the id quoted."""
    if not isinstance(run_id, str) or not run_id:
        raise ValueError("run_id must be a non-empty string")
    return "/".join((f"{API_PREFIX}/runs", quote(run_id, safe=""), *rest))


def _json_bytes(value: JsonObject) -> bytes:
    try:
        return json.dumps(value, allow_nan=False, separators=(",", ":")).encode()
    except ValueError as exc:
        raise ValueError("a coordinator request cannot carry NaN or infinity") from exc
