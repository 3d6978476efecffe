"""Errors the coordinator's services raise on purpose; the app turns them into JSON.

Hierarchy::

    CoordinatorError          base; carries an HTTP status and a ``detail`` for people
    ├── Unauthenticated       401: no token, or one that is unknown, expired, revoked, used up
    ├── Forbidden             403: a valid token of the wrong scope or for another run
    ├── NotFound              404: no such run, token, ...
    └── Conflict              409: the request contradicts the resource's state
"""

from __future__ import annotations


class CoordinatorError(Exception):
    status_code = 500

    def __init__(self, detail: str) -> None:
        super().__init__(detail)
        self.detail = detail


class Unauthenticated(CoordinatorError):
    status_code = 401


class Forbidden(CoordinatorError):
    status_code = 403


class NotFound(CoordinatorError):
    status_code = 404


class Conflict(CoordinatorError):
    status_code = 409
