"""The volunteer's side of the coordinator: its REST API and a background session.

:class:`CoordinatorClient` makes the calls (join, reachability, reports, certificates,
checkpoints; the organizer's runs and invites); :class:`CoordinatorSession` keeps a joined
peer's certificate fresh and its reports flowing on a background thread, without ever making
training wait. Every failure is a :class:`CoordinatorError` (see
:mod:`peer.coordinator.exceptions`).

This package talks HTTP with httpx only: it never imports the coordinator's own code.
"""

from __future__ import annotations

from peer.coordinator.client import (
    CoordinatorClient,
    JoinAnswer,
    JoinChallenge,
    Reachability,
)
from peer.coordinator.exceptions import (
    CoordinatorError,
    CoordinatorFailed,
    CoordinatorUnreachable,
    Forbidden,
    NotACoordinator,
    NotFound,
    RateLimited,
    RequestRejected,
    RunNotAccepting,
    Unauthorized,
)
from peer.coordinator.reports import ReportFields, ReportQueue, clean_report, merge_reports
from peer.coordinator.responses import when_allowed
from peer.coordinator.session import CoordinatorSession, SessionTimings

__all__ = [
    "CoordinatorClient",
    "CoordinatorError",
    "CoordinatorFailed",
    "CoordinatorSession",
    "CoordinatorUnreachable",
    "Forbidden",
    "JoinAnswer",
    "JoinChallenge",
    "NotACoordinator",
    "NotFound",
    "RateLimited",
    "Reachability",
    "ReportFields",
    "ReportQueue",
    "RequestRejected",
    "RunNotAccepting",
    "SessionTimings",
    "Unauthorized",
    "clean_report",
    "merge_reports",
    "when_allowed",
]
