"""The transport seam: connect to an address, listen with a handler, send and receive
whole binary messages. Everything above it (handshake, gossip, averaging) is written
against these two small abstract classes, so tests and the simulator can swap the
WebSocket implementation for the in-memory one.
"""

from __future__ import annotations

import abc
import ipaddress
import urllib.parse
from collections.abc import Awaitable, Callable, Sequence

Data = bytes | bytearray | memoryview
Message = Data | Sequence[Data]
"""A message to send: one buffer, or several sent back to back as one message (so a header
and a tensor view can go out without being concatenated first)."""


#: the largest message a peer may send before it has shown a valid credential (a hello with
#: a certificate and addresses takes a few KiB)
PRE_AUTH_MESSAGE_BYTES = 64 * 1024


#: An IPv6 source is its whole network of this prefix length: one subscriber commonly holds
#: a /56 or a /48 (a /64 is one LAN of it), and could otherwise pass as hundreds of sources.
IPV6_SOURCE_PREFIX = 56


def source_of(address: str) -> str:
    """Who a connection from ``address`` (a URL like ``ws://198.51.100.7:50312``, or a bare
    host) counts as, for limits per source: its IP address, or for IPv6 its network of
    :data:`IPV6_SOURCE_PREFIX` bits; the host part as it is when it is not an IP address.
    A connection through a relay (``relay://host:port/<peer id>``) counts as its dialer,
    whom the relay authenticated: the relay's own address stands for many peers."""
    if address.startswith("relay://"):
        return address
    host = urllib.parse.urlsplit(address).hostname if "//" in address else address
    if not host:
        return address
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return host
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is None:
        return str(ipaddress.IPv6Network((ip, IPV6_SOURCE_PREFIX), strict=False))
    return str(ip.ipv4_mapped or ip) if isinstance(ip, ipaddress.IPv6Address) else str(ip)


class Connection(abc.ABC):
    """A bidirectional, ordered, reliable-or-failing stream of binary messages."""

    remote_address: str

    @abc.abstractmethod
    async def send(self, message: Message) -> None:
        """Send one message; waits while the peer is slow (back-pressure).

        Raises :class:`~peer.exceptions.ConnectionClosed` once the connection is closed."""

    @abc.abstractmethod
    async def recv(self) -> bytes:
        """The next whole message. Raises ConnectionClosed when there will be no more."""

    @abc.abstractmethod
    async def close(self, reason: str = "", *, protocol_error: bool = False) -> None:
        """Close the connection, telling the other side ``reason`` where the transport can."""

    @property
    @abc.abstractmethod
    def closed(self) -> bool: ...

    @property
    def close_reason(self) -> str:
        """Why the connection was closed, as far as this side knows ("" if open or unknown)."""
        return ""

    def limit_incoming(self, max_bytes: int) -> None:  # noqa: B027 - optional for transports
        """Refuse (close on) incoming messages over ``max_bytes`` from now on, where the
        transport can bound what it buffers. The handshake keeps this small until the
        other side has shown a valid credential."""


Handler = Callable[[Connection], Awaitable[None]]


class Listener(abc.ABC):
    """A running server; ``addresses`` are the ones other peers can dial."""

    addresses: list[str]

    @abc.abstractmethod
    async def close(self) -> None: ...


class Transport(abc.ABC):
    @abc.abstractmethod
    async def connect(self, address: str, *, timeout: float) -> Connection:
        """Open a connection. Raises :class:`~peer.exceptions.TransportError` on failure."""

    @abc.abstractmethod
    async def listen(self, host: str, port: int, handler: Handler) -> Listener:
        """Serve incoming connections with ``handler`` (one task per connection; the
        connection is closed when the handler returns)."""

    @property
    @abc.abstractmethod
    def max_message_bytes(self) -> int: ...

    #: whether peers on this transport are TCP hosts that can also open bulk lanes
    #: (:mod:`peer.transport.bulk`) for large one-way frames
    supports_bulk_lanes: bool = False
