"""What the coordinator's answers mean: the error an answer of status 400 or more stands for
(one line, with the coordinator's own ``detail``), how long a 429 asks to wait, a transport
failure in a few words, and :func:`when_allowed`, which waits out rate limits for the calls
a peer cannot do without."""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Callable
from typing import TypeVar

import httpx

from peer.coordinator.exceptions import (
    CoordinatorError,
    CoordinatorFailed,
    Forbidden,
    NotFound,
    RateLimited,
    RequestRejected,
    RunNotAccepting,
    Unauthorized,
)

MAX_MESSAGE_CHARS = 300
# How long a one-off call (joining, a certificate) keeps waiting out rate limits.
RATE_LIMIT_PATIENCE_S = 300.0

logger = logging.getLogger("peer.coordinator")
_T = TypeVar("_T")

_STATUS_ERRORS: dict[int, type[CoordinatorError]] = {
    401: Unauthorized,
    403: Forbidden,
    404: NotFound,
    409: RunNotAccepting,
}


def when_allowed(
    call: Callable[[], _T],
    *,
    patience: float = RATE_LIMIT_PATIENCE_S,
    sleep: Callable[[float], None] = time.sleep,
    clock: Callable[[], float] = time.monotonic,
) -> _T:
    """``call()``; each time the coordinator answers 429 (:class:`RateLimited`), wait its
    ``Retry-After`` and call again, for up to ``patience`` seconds in all — then the
    :class:`RateLimited` propagates. For one-off calls a peer cannot do without (joining,
    a certificate); the session's periodic calls reschedule themselves instead."""
    deadline = clock() + patience
    while True:
        try:
            return call()
        except RateLimited as exc:
            wait = max(exc.retry_after, 0.1)
            if clock() + wait > deadline:
                raise
            logger.info("the coordinator asks to wait %.0f s (%s); waiting", wait, exc)
            sleep(wait)


def reason(exc: Exception) -> str:
    """``[Errno 111] Connection refused`` → ``connection refused``: one short line."""
    text = one_line(str(exc))
    text = re.sub(r"^\[Errno -?\d+\]\s*", "", text)
    if not text:
        return type(exc).__name__
    return text[0].lower() + text[1:]


def one_line(text: str) -> str:
    text = " ".join(text.split())
    if len(text) > MAX_MESSAGE_CHARS:
        text = text[: MAX_MESSAGE_CHARS - 1] + "…"
    return text


def _detail(response: httpx.Response) -> str:
    """The coordinator's ``detail``, as one line."""
    try:
        body = response.json()
    except ValueError:
        body = None
    detail = body.get("detail") if isinstance(body, dict) else None
    if isinstance(detail, str) and detail.strip():
        return one_line(detail)
    if isinstance(detail, list) and detail:
        return one_line("; ".join(_validation_problem(item) for item in detail[:3]))
    return f"HTTP {response.status_code} {response.reason_phrase}".strip()


def _validation_problem(item: object) -> str:
    """``{"loc": ["body", "port"], "msg": "..."}`` → ``port: ...``."""
    if not isinstance(item, dict):
        return str(item)
    where = item.get("loc", ())
    parts = where if isinstance(where, list | tuple) else ()
    loc = [str(p) for p in parts if p not in ("body", "query", "path", "header")]
    # pydantic prefixes a validator's own message; the message alone reads as the reason
    message = str(item.get("msg", "invalid")).removeprefix("Value error, ")
    return f"{'.'.join(loc)}: {message}" if loc else message


def error_from(response: httpx.Response) -> CoordinatorError:
    """The error an answer of status 400 or more stands for, with the coordinator's detail."""
    code = response.status_code
    detail = _detail(response)
    if code == 429:
        return RateLimited(detail, retry_after=_retry_after(response))
    if code >= 500:
        return CoordinatorFailed(detail, status_code=code)
    return _STATUS_ERRORS.get(code, RequestRejected)(detail, status_code=code)


def _retry_after(response: httpx.Response) -> float:
    try:
        return max(0.0, float(response.headers.get("Retry-After", "1")))
    except ValueError:
        return 1.0
