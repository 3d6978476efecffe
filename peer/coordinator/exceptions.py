"""Errors of the coordinator client: what went wrong talking to a Swarmgrad coordinator.

Hierarchy::

    SwarmgradError
    └── CoordinatorError           root of everything the coordinator client raises
        ├── CoordinatorUnreachable no answer: connection refused, unknown host, timeout,
        │                          connection lost, or a gateway saying the coordinator
        │                          behind it is down (502/503/504 without the coordinator
        │                          header)
        ├── NotACoordinator        something answered, but not a Swarmgrad coordinator
        ├── Unauthorized           401: token missing, unknown, expired, revoked or used up
        ├── Forbidden              403: token of the wrong scope or run, or a join proof refused
        ├── NotFound               404: no such run (or no checkpoint yet)
        ├── RunNotAccepting        409: the run is finished or archived (or, for a
        │                          checkpoint upload, has one of that epoch or newer)
        ├── RateLimited            429: too soon; ``retry_after`` seconds to wait
        ├── RequestRejected        400/413/422 and other 4xx: the coordinator refused the
        │                          request as malformed or too large
        └── CoordinatorFailed      5xx: the coordinator (or its database) failed

``str(exc)`` is one human line: the coordinator's ``detail`` where it sent one. Messages
name the coordinator's host, never a token or a URL's credentials. ``status_code`` is the
HTTP status (None when there was no HTTP answer).
"""

from __future__ import annotations

from peer.exceptions import SwarmgradError


class CoordinatorError(SwarmgradError):
    """Root of the errors raised when talking to a coordinator."""

    def __init__(self, message: str, *, status_code: int | None = None) -> None:
        super().__init__(message)
        self.detail = message
        self.status_code = status_code


class CoordinatorUnreachable(CoordinatorError):
    """No answer from the coordinator; retrying later may work."""


class NotACoordinator(CoordinatorError):
    """Something answered at the URL, but it is not a Swarmgrad coordinator (a captive
    portal, a proxy's error page, another service): check the URL."""


class Unauthorized(CoordinatorError):
    """401: the token is missing, unknown, expired, revoked or used up; ask for a new one."""


class Forbidden(CoordinatorError):
    """403: the token is valid but not for this (a wrong scope or another run), or the
    coordinator refused a join proof."""


class NotFound(CoordinatorError):
    """404: no such run, or nothing there yet."""


class RunNotAccepting(CoordinatorError):
    """409: the request conflicts with the run's state: it is finished or archived. A
    checkpoint upload gets it when the run already holds a checkpoint of that epoch or a
    newer one (another peer was first)."""


class RateLimited(CoordinatorError):
    """429: asked too soon; try again after ``retry_after`` seconds."""

    def __init__(
        self, message: str, *, status_code: int | None = 429, retry_after: float = 1.0
    ) -> None:
        super().__init__(message, status_code=status_code)
        self.retry_after = retry_after


class RequestRejected(CoordinatorError):
    """400/413/422 (and other 4xx): the coordinator refused the request itself — malformed,
    out of range or too large. Sending it again will not help."""


class CoordinatorFailed(CoordinatorError):
    """5xx: the coordinator or its database failed; retrying later may work."""
