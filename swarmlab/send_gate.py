"""Faults in sending, injected at the averaging seam: a :class:`~peer.averaging.seam.NodeCore`
whose data sends wait on a hook first.

A round's runner sends its parts and averages over ``core.link(peer).send`` or
``core.bulk.send``; :class:`GatedCore` wraps a node's core so that each of those sends first
awaits ``before_send(peer_id, frame)``, which may hold it (a gate), never return (a peer
that stalls) or end the process (one that dies mid-round). Everything else goes to the node
unchanged. Give it to an averager's rounds with :func:`gated_runner`::

    averager_with(runner=gated_runner(before_send))(tensors, node, ...)

(:func:`swarmlab.averager_doubles.averager_with`).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any, cast

from peer.averaging.allreduce.runner import AllreduceRunner, RunnerFactory
from peer.averaging.seam import Lanes, Link, NodeCore
from peer.wire import Frame

__all__ = ["BeforeSend", "GatedCore", "gated_runner"]

#: awaited before each data frame a round sends: ``(peer id, frame)``
BeforeSend = Callable[[str, Frame], Awaitable[None]]


class _GatedLink:
    def __init__(self, link: Link, before_send: BeforeSend) -> None:
        self._link = link
        self._before_send = before_send

    @property
    def peer_id(self) -> str:
        return self._link.peer_id

    @property
    def closed(self) -> bool:
        return self._link.closed

    async def send(self, frame: Frame) -> None:
        await self._before_send(self._link.peer_id, frame)
        await self._link.send(frame)


class _GatedLanes:
    def __init__(self, lanes: Lanes, before_send: BeforeSend) -> None:
        self._lanes = lanes
        self._before_send = before_send

    def last_heard(self, peer_id: str) -> float:
        return self._lanes.last_heard(peer_id)

    def last_taken(self, peer_id: str) -> float:
        return self._lanes.last_taken(peer_id)

    async def send(self, peer_id: str, frame: Frame, idle_timeout: float | None = None) -> None:
        await self._before_send(peer_id, frame)
        await self._lanes.send(peer_id, frame, idle_timeout)


class GatedCore:
    """``core``, except that frames sent over its links and bulk lanes first await
    ``before_send``; one-way ``send`` (notices, aborts) is not gated."""

    def __init__(self, core: NodeCore, before_send: BeforeSend) -> None:
        self._core = core
        self._before_send = before_send

    @property
    def bulk(self) -> Lanes | None:
        lanes = self._core.bulk
        return None if lanes is None else _GatedLanes(lanes, self._before_send)

    async def link(self, peer_id: str) -> Link:
        return _GatedLink(await self._core.link(peer_id), self._before_send)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._core, name)


def gated_runner(before_send: BeforeSend, base: RunnerFactory = AllreduceRunner) -> RunnerFactory:
    """A runner factory (an averager's ``runner_class``): rounds built by ``base`` whose
    sends await ``before_send`` first."""

    def build(core: NodeCore, *args: Any, **kwargs: Any) -> AllreduceRunner:
        return base(cast(NodeCore, GatedCore(core, before_send)), *args, **kwargs)

    return build
