"""Averagers with test doubles for their parts: :func:`averager_with`.

A :class:`~peer.averaging.DecentralizedAverager` builds each round's runner with its class's
``runner_class`` and its donor side with ``state_server_class``; a test or benchmark that
wants one peer to misbehave or count builds that peer from a subclass that overrides them::

    Averager = averager_with(runner=gated_runner(hold))
    Averager(tensors, node, start=True, prefix="p")
"""

from __future__ import annotations

from peer.averaging.allreduce.runner import RunnerFactory
from peer.averaging.averager import DecentralizedAverager
from peer.averaging.sharing.state_sharing import StateServerFactory

__all__ = ["averager_with"]


def averager_with(
    *, runner: RunnerFactory | None = None, state_server: StateServerFactory | None = None
) -> type[DecentralizedAverager]:
    """A subclass of :class:`~peer.averaging.DecentralizedAverager` whose ``runner_class``
    is ``runner`` and ``state_server_class`` is ``state_server`` (each a class or any callable
    taking that class's arguments; None keeps the default)."""

    class Averager(DecentralizedAverager):
        pass

    if runner is not None:
        Averager.runner_class = runner
    if state_server is not None:
        Averager.state_server_class = state_server
    return Averager
