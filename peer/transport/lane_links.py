"""What bulk lanes need from the node that owns them: its authenticated links.

Lanes live in the transport layer and never import the node: :class:`LaneLinks` names the
three things they use (a link to a peer, to ask it for a ticket; a one-way send over the
link, when no lane can carry a frame; the count of bytes sent), and the node hands itself
to :class:`~peer.transport.bulk.BulkLanes` as one. :class:`TicketLink` is what the lanes
read of a link.
"""

from __future__ import annotations

from typing import Protocol

from peer.transport.base import Connection
from peer.transport.secure import SessionKeys
from peer.wire import Frame

__all__ = ["LaneLinks", "TicketLink"]


class TicketLink(Protocol):
    """An authenticated link: whose it is, its session's keys, its connection's address,
    and a request over it."""

    @property
    def peer_id(self) -> str: ...

    @property
    def keys(self) -> SessionKeys | None: ...  # None on a trusted network (no encryption)

    @property
    def conn(self) -> Connection: ...

    async def request(self, frame: Frame, timeout: float | None) -> Frame: ...


class LaneLinks(Protocol):
    """The node's links, as its bulk lanes use them."""

    async def link(self, peer_id: str) -> TicketLink:
        """An authenticated link to ``peer_id`` (TransportError when none can be had)."""
        ...

    async def send(self, peer_id: str, frame: Frame) -> None:
        """Send a one-way frame over the link to ``peer_id``."""
        ...

    def count_sent(self, nbytes: int) -> None:
        """Count bytes sent to peers (on lanes as on links)."""
        ...
