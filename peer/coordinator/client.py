"""``CoordinatorClient``: the coordinator's REST API, as a volunteer and an organizer see it.

Its calls are those of :class:`~peer.coordinator.volunteer_calls.VolunteerCalls` (join,
reachability, reports, certificates, checkpoints) and of
:class:`~peer.coordinator.organizer_calls.OrganizerCalls` (runs, invites, organizer tokens),
over one :class:`~peer.coordinator.connection.CoordinatorConnection` (HTTP, tokens, failures
as :class:`~peer.coordinator.exceptions.CoordinatorError`). Each call sends its request of
:mod:`peer.formats.requests` and returns its answer of :mod:`peer.formats.payloads` (or a
volunteer's answer kept as :class:`JoinAnswer`, ...), the classes the coordinator's routes
validate with, so mypy checks every use of a field against the coordinator's own
description of it.
"""

from __future__ import annotations

from peer.coordinator.organizer_calls import OrganizerCalls
from peer.coordinator.volunteer_calls import (
    JoinAnswer,
    JoinChallenge,
    Reachability,
    VolunteerCalls,
)

__all__ = ["CoordinatorClient", "JoinAnswer", "JoinChallenge", "Reachability"]


class CoordinatorClient(VolunteerCalls, OrganizerCalls):
    """The coordinator at ``url`` (``http://host:port`` or ``https://...``, with a path
    prefix if it sits behind one): its calls, for a volunteer and for an organizer.

    ``timeout`` bounds each network operation (connect, each read and write), not a whole
    transfer. ``transport`` replaces the network (``httpx.MockTransport`` in tests). Use as a
    context manager or call :meth:`close`.
    """

    def __repr__(self) -> str:
        return f"CoordinatorClient({self.host!r})"
