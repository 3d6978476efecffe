"""What averaging needs of a node, typed: the seam between :mod:`peer.averaging` and
:mod:`peer.node`.

Averaging talks to its node's event-loop side (:class:`peer.node.AsyncNode`) through
:class:`NodeCore` only: gossip records, requests and one-way frames to peers, the handlers
it registers, and the bulk lanes' signs of life. An averager is handed the node as training
code holds it (:class:`peer.Node`, the synchronous facade): :class:`NodeHandle` is what it
uses of that — identity, mode, clock, the loop to run its coroutines on, and the core. Anything satisfying these protocols can
carry averaging (the node over WebSockets, or over the in-memory transport of the tests);
mypy checks that the node does.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections.abc import Awaitable, Callable, Coroutine, Mapping
from typing import TYPE_CHECKING, Any, Literal, Protocol, TypeVar, overload

from peer.formats.open_types import UserMetadata
from peer.node.gossip import Subkey, ValueWithExpiration
from peer.wire import Frame, MessageRegistry, Schema

T = TypeVar("T")

__all__ = ["Handler", "Lanes", "Link", "MemberRecord", "NodeCore", "NodeHandle"]

#: a request or message handler: ``(link it came over, frame) -> reply or None``
Handler = Callable[[Any, Frame], Awaitable[Frame | None]]


class Link(Protocol):
    """An authenticated connection to one peer."""

    @property
    def peer_id(self) -> str: ...

    @property
    def closed(self) -> bool: ...

    async def send(self, frame: Frame) -> None: ...


class Lanes(Protocol):
    """The node's bulk lanes, as a round sees them: a way to send large frames, and when
    bytes last moved on them (a frame under way is a sign of life before it is complete)."""

    def last_heard(self, peer_id: str) -> float:
        """Loop time bytes last arrived from ``peer_id`` on a lane (0.0: never)."""
        ...

    def last_taken(self, peer_id: str) -> float:
        """Loop time the lane to ``peer_id`` last took bytes to send (0.0: never)."""
        ...

    async def send(self, peer_id: str, frame: Frame, idle_timeout: float | None = None) -> None: ...


class MemberRecord(Protocol):
    """A live member of the swarm, as averaging reads it."""

    @property
    def leaving(self) -> bool: ...


class NodeCore(Protocol):
    """A node's event-loop side, as averaging uses it."""

    def members(self) -> Mapping[str, MemberRecord]:
        """Peers whose membership record is live, this node included."""
        ...

    @property
    def peer_id(self) -> str: ...

    @property
    def registry(self) -> MessageRegistry: ...

    @property
    def bulk(self) -> Lanes | None: ...

    def now(self) -> float:
        """The node's wall clock (seconds): what gossip expirations are measured in."""
        ...

    def certified_role(self, peer_id: str) -> str | None: ...

    def certified_volunteer(self, peer_id: str) -> str | None:
        """The person ``peer_id``'s certificate names (None: not known)."""
        ...

    def certified_invite(self, peer_id: str) -> str | None:
        """The invite that admitted that person, as the certificate names it (None: not
        known)."""
        ...

    async def get(
        self, key: str, latest: bool = False
    ) -> ValueWithExpiration[UserMetadata] | None: ...

    async def store(
        self, key: str, value: object, expiration_time: float, subkey: Subkey = None
    ) -> bool: ...

    def watch(self, key: str, callback: Callable[[], None]) -> Callable[[], None]: ...

    async def link(self, peer_id: str) -> Link: ...

    async def request(self, peer_id: str, frame: Frame, timeout: float | None = None) -> Frame: ...

    async def send(self, peer_id: str, frame: Frame) -> None: ...

    def register_handler(self, message_type: str, schema: Schema, handler: Handler) -> None: ...

    def accept_bulk(
        self, message_type: str, inline: Callable[[str, Frame], None] | None = None
    ) -> None: ...


class NodeHandle(Protocol):
    """A node as the training code holds it (:class:`peer.Node`), as an averager uses it."""

    @property
    def peer_id(self) -> str: ...

    @property
    def client_mode(self) -> bool: ...

    @property
    def loop(self) -> asyncio.AbstractEventLoop: ...

    @property
    def core(self) -> NodeCore: ...

    def get_time(self) -> float:
        """The node's wall clock (seconds), as :meth:`NodeCore.now`."""
        ...

    @overload
    def run_coroutine(
        self, coro: Coroutine[object, object, T], *, wait: Literal[True] = True
    ) -> T: ...
    @overload
    def run_coroutine(
        self, coro: Coroutine[object, object, T], *, wait: Literal[False]
    ) -> concurrent.futures.Future[T]: ...
    @overload
    def run_coroutine(
        self, coro: Coroutine[object, object, T], *, wait: bool = True
    ) -> T | concurrent.futures.Future[T]: ...
    def run_coroutine(
        self, coro: Coroutine[object, object, T], *, wait: bool = True
    ) -> T | concurrent.futures.Future[T]:
        """Run ``coro`` on the node's loop: its result, or a future with ``wait=False``."""
        ...


if TYPE_CHECKING:  # mypy checks that the node is what averaging takes it for
    from peer.node import AsyncNode, Node

    def _core(node: AsyncNode) -> NodeCore:
        return node

    def _handle(node: Node) -> NodeHandle:
        return node
