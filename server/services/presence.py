"""Whether a peer counts as online: heard from within the presence window and not left
since. Every query that decides it uses these, so the rule lives here only.

A volunteer that stops cleanly says so (``POST /runs/{run_id}/leave``), which records
``left_ms`` on the coordinator's clock; it shows offline at once. A later report or join
moves ``last_seen_ms`` past ``left_ms`` and brings it back. One that dies without a word
shows offline once ``last_seen_ms`` falls out of the window. ``last_seen_ms`` stays the
real last contact either way.
"""

from __future__ import annotations

from sqlalchemy import ColumnElement, case

from server.models import Peer


def present() -> ColumnElement[bool]:
    """SQL: the peer has not left since it was last heard from."""
    return Peer.left_ms.is_(None) | (Peer.last_seen_ms > Peer.left_ms)


def online(since: int) -> ColumnElement[bool]:
    """SQL: the peer was heard from at or after ``since`` (ms) and has not left since."""
    return (Peer.last_seen_ms >= since) & present()


def present_seen_ms() -> ColumnElement[int | None]:
    """SQL: ``last_seen_ms``, or null for a peer that left since (for aggregates: a
    volunteer is online when the greatest of its peers' is at or after ``since``)."""
    return case((present(), Peer.last_seen_ms), else_=None)


def is_online(peer: Peer, since: int) -> bool:
    """:func:`online` for a loaded row."""
    return peer.last_seen_ms >= since and (peer.left_ms is None or peer.last_seen_ms > peer.left_ms)
