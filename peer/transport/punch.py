"""TCP hole punching: a connection through two home routers by simultaneous open.

Two peers behind NATs cannot dial each other, but if both send a SYN to the other's public
endpoint at about the same time, each router takes the other's SYN as the answer to its own
and the hosts complete a simultaneous open (RFC 9293, 3.5). This works through routers that
map a port to the same public port for every destination (endpoint-independent mapping, as
Linux's masquerade and most home routers do); a symmetric router needs a relay instead.

A node punches from one local port, its :class:`PunchPort`, which never listens: the only
way in is a simultaneous open with a peer this node punches toward. Each attempt of
:func:`simultaneous_open` binds that port again and keeps its SYN going out for
``attempt_s``, retrying until the deadline, so the two sides need only overlap. The
connected socket carries an ordinary link: :func:`dials_first` says which side opens the
WebSocket connection, then the node's handshake authenticates both ends.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import ipaddress
import socket
import time
import urllib.parse
from dataclasses import dataclass

__all__ = [
    "PunchEndpoint",
    "PunchFailed",
    "PunchPort",
    "dials_first",
    "is_punch_address",
    "parse_punch_address",
    "simultaneous_open",
]

SCHEME = "punch"


@dataclass(frozen=True, slots=True)
class PunchEndpoint:
    """Where a peer behind a NAT can be punched: its router's public address as the
    coordinator saw it (``host``, an IP address), the port it punches from, and its id."""

    host: str
    port: int
    peer_id: str

    def __post_init__(self) -> None:
        try:
            ipaddress.ip_address(self.host)
        except ValueError:
            raise ValueError(
                f"a punch endpoint's host is an IP address, not {self.host!r}"
            ) from None
        if not 1 <= self.port <= 65535:
            raise ValueError(f"a punch endpoint's port is 1 to 65535, not {self.port}")
        if not self.peer_id:
            raise ValueError("a punch endpoint names its peer")

    @property
    def address(self) -> str:
        """``punch://host:port/<peer id>``: how a member record names it."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{SCHEME}://{host}:{self.port}/{self.peer_id}"


def is_punch_address(address: str) -> bool:
    return address.startswith(f"{SCHEME}://")


def parse_punch_address(address: str) -> PunchEndpoint:
    """The endpoint a ``punch://host:port/<peer id>`` address names; ValueError if it is
    not one."""
    parts = urllib.parse.urlsplit(address)
    if parts.scheme != SCHEME or not parts.hostname or parts.query or parts.fragment:
        raise ValueError(f"not a punch address: {address!r}")
    try:
        port = parts.port
    except ValueError:
        port = None
    if port is None:
        raise ValueError(f"a punch address names a port: {address!r}")
    return PunchEndpoint(parts.hostname, port, parts.path.lstrip("/"))


class PunchFailed(ConnectionError):
    """No simultaneous open came about before the deadline (the message says what was
    seen last: no answer, resets, unreachable)."""


def dials_first(own_id: str, other_id: str) -> bool:
    """Whether this side opens the WebSocket connection over a punched socket (the other
    serves it): the peer whose id sorts first. Both sides compute the same answer."""
    if own_id == other_id:
        raise ValueError("a peer does not punch toward itself")
    return own_id < other_id


def _reusable(port: int, host: str = "0.0.0.0") -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if hasattr(socket, "SO_REUSEPORT"):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind((host, port))
    except BaseException:
        sock.close()
        raise
    sock.setblocking(False)
    return sock


class PunchPort:
    """The local TCP port a node punches from: reserved while open (a bound socket that
    never listens). ``port=0`` takes a free one. Close it when the node stops."""

    def __init__(self, port: int = 0, host: str = "0.0.0.0") -> None:
        if not 0 <= port <= 65535:
            raise ValueError(f"a port is 0 to 65535, not {port}")
        self.host = host
        self._sock: socket.socket | None = _reusable(port, host)
        self.port: int = self._sock.getsockname()[1]

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    @property
    def closed(self) -> bool:
        return self._sock is None

    def socket(self) -> socket.socket:
        """A fresh, non-blocking socket bound to the port, for one attempt."""
        if self._sock is None:
            raise PunchFailed("the punch port is closed")
        return _reusable(self.port, self.host)


async def simultaneous_open(
    port: PunchPort,
    host: str,
    remote_port: int,
    *,
    timeout: float,
    attempt_s: float = 4.0,
) -> socket.socket:
    """A TCP connection from ``port`` to ``host:remote_port`` that the other side opens
    toward this one at about the same time (see the module's docstring): attempts of
    ``attempt_s`` each, again and again, until one connects or ``timeout`` has passed.
    Returns the connected, non-blocking socket; raises :class:`PunchFailed`."""
    if timeout <= 0 or attempt_s <= 0:
        raise ValueError("timeout and attempt_s are positive")
    loop = asyncio.get_running_loop()
    deadline = time.monotonic() + timeout
    last = "no answer"
    while (left := deadline - time.monotonic()) > 0:
        sock = port.socket()
        try:
            async with asyncio.timeout(min(attempt_s, left)):
                await loop.sock_connect(sock, (host, remote_port))
        except TimeoutError:
            last = "no answer"
        except OSError as exc:
            # A reset: the other host's SYN-SENT connection did not exist yet (or it no
            # longer punches). Unreachable: a router said so. Address in use: the last
            # connection to this peer from this port is in TIME-WAIT. Each is worth another
            # attempt after a pause, not a busy loop.
            last = {
                errno.ECONNREFUSED: "reset by the other side",
                errno.EADDRNOTAVAIL: "the last connection to it is still closing",
                errno.EADDRINUSE: "the last connection to it is still closing",
            }.get(exc.errno or 0, (exc.strerror or type(exc).__name__).lower())
            sock.close()
            with contextlib.suppress(TimeoutError):
                await asyncio.sleep(min(0.25, max(0.0, deadline - time.monotonic())))
            continue
        except BaseException:
            sock.close()
            raise
        else:
            return sock
        sock.close()
    raise PunchFailed(f"no connection through to {host}:{remote_port} in {timeout:g} s ({last})")
