"""Errors the coordinator's services raise on purpose; the app turns them into JSON.

Hierarchy::

    CoordinatorError          base; carries an HTTP status and a ``detail`` for people
    ├── Unauthenticated       401: no token, or one that is unknown, expired, revoked, used up
    ├── Forbidden             403: a valid token of the wrong scope or for another run, or a
    │                              join without proof of holding the key
    ├── NotFound              404: no such run, token, checkpoint, ...
    ├── Conflict              409: the request contradicts the resource's state
    ├── PayloadTooLarge       413: a body over its limit
    ├── InvalidContent        422: a body that is not what the route takes (a checkpoint
    │   │                          that is not a zip archive)
    │   └── ImplausibleReport      a progress report past a plausibility bound (``bound``)
    ├── RateLimited           429: too soon; ``retry_after`` seconds until the next try
    ├── Unavailable           503: the coordinator cannot store anything more for now;
    │                              ``retry_after`` seconds until the next try
    └── InsufficientStorage   507: the coordinator could not store the upload (disk full)
"""

from __future__ import annotations

import math


class CoordinatorError(Exception):
    status_code = 500

    def __init__(self, detail: str) -> None:
        super().__init__(detail)
        self.detail = detail

    @property
    def headers(self) -> dict[str, str] | None:
        """Extra response headers."""
        return None


class Unauthenticated(CoordinatorError):
    status_code = 401

    @property
    def headers(self) -> dict[str, str] | None:
        return {"WWW-Authenticate": "Bearer"}


class Forbidden(CoordinatorError):
    status_code = 403


class NotFound(CoordinatorError):
    status_code = 404


class Conflict(CoordinatorError):
    status_code = 409


class PayloadTooLarge(CoordinatorError):
    status_code = 413


class InvalidContent(CoordinatorError):
    status_code = 422


class ImplausibleReport(InvalidContent):
    def __init__(self, bound: str, detail: str) -> None:
        super().__init__(detail)
        self.bound = bound


class _TryLater(CoordinatorError):
    """Answered with ``Retry-After``: ``retry_after`` whole seconds, at least 1."""

    def __init__(self, detail: str, retry_after_s: float) -> None:
        super().__init__(detail)
        self.retry_after = max(1, math.ceil(retry_after_s))

    @property
    def headers(self) -> dict[str, str] | None:
        return {"Retry-After": str(self.retry_after)}


class RateLimited(_TryLater):
    status_code = 429


class Unavailable(_TryLater):
    status_code = 503


class InsufficientStorage(CoordinatorError):
    status_code = 507
