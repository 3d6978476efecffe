"""uvicorn's HTTP protocol with a deadline for request headers and caps on connections.

uvicorn holds a connection that never completes a request open for ever, and refuses no
connection. :class:`GuardedHttpToolsProtocol` (uvicorn's default httptools protocol) adds:

* **a header deadline**: a request's headers must be complete within ``header_timeout_s``
  of the connection's opening or its previous response (bodies and WebSockets unbounded);
* **a header size bound**: headers over ``max_header_bytes`` are answered 431 and closed;
* **a connection cap**: beyond ``max_connections`` in this worker, a connection is closed;
* **a cap per source**: at most ``max_pending_per_source`` connections from one address (an
  IPv6 network) waiting for their first headers; trusted proxies are exempt.

Give it to uvicorn as ``http=`` with :func:`guarded_protocol` (a picklable factory, so that
worker processes get it too).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import ipaddress
import logging
from collections import Counter
from dataclasses import dataclass, field
from typing import cast

from uvicorn.config import Config
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
from uvicorn.server import ServerState

from server.services.rate_limits import DEFAULT_IPV6_PREFIX, address_key

logger = logging.getLogger(__name__)

#: connections closed at once are logged together, at most this often
LOG_EVERY_S = 10.0

HEADERS_TOO_LARGE = (
    b"HTTP/1.1 431 Request Header Fields Too Large\r\n"
    b"content-type: text/plain; charset=utf-8\r\nconnection: close\r\ncontent-length: 33\r\n\r\n"
    b"request line and headers too long"
)


@dataclass
class ConnectionGuard:
    """The bounds, and the count of connections still waiting for their first headers per
    source. One per worker process (each unpickles its own)."""

    header_timeout_s: float
    max_connections: int
    max_pending_per_source: int
    max_header_bytes: int = 64 * 1024
    ipv6_prefix: int = DEFAULT_IPV6_PREFIX
    #: addresses or networks (settings.trusted_proxies) not held to max_pending_per_source
    exempt: tuple[str, ...] = ()
    pending: Counter[str] = field(default_factory=Counter)
    _refused: Counter[str] = field(default_factory=Counter)
    _logged_at: float | None = None

    def refused(self, why: str, now: float) -> None:
        """Count a connection closed at once; a warning at most every :data:`LOG_EVERY_S`."""
        self._refused[why] += 1
        if self._logged_at is not None and now - self._logged_at < LOG_EVERY_S:
            return
        self._logged_at = now
        for reason, count in self._refused.items():
            logger.warning("closed %d new connection(s) at once: %s", count, reason)
        self._refused.clear()

    def source(self, client: tuple[str, int] | None) -> str | None:
        """Whom a connection from ``client`` counts against; None for an exempt proxy."""
        host = client[0] if client else None
        with contextlib.suppress(ValueError):
            ip = ipaddress.ip_address(host or "")
            if any(ip in ipaddress.ip_network(n, strict=False) for n in self.exempt):
                return None
        # Loopback counts too (by address), unless it is a trusted proxy.
        return address_key(host, self.ipv6_prefix) or str(host)


class GuardedHttpToolsProtocol(HttpToolsProtocol):
    def __init__(
        self,
        config: Config,
        server_state: ServerState,
        app_state: dict[str, object],
        _loop: asyncio.AbstractEventLoop | None = None,
        *,
        guard: ConnectionGuard,
    ) -> None:
        super().__init__(config, server_state, app_state, _loop)
        self.guard = guard
        self._deadline: asyncio.TimerHandle | None = None
        self._pending_source: str | None = None
        self._header_bytes: int | None = None  # None once a request's headers are complete

    # Narrowed to asyncio.Transport as in uvicorn's own protocol, which this extends.
    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        guard = self.guard
        if len(self.connections) > guard.max_connections:
            guard.refused("this worker holds SWARMGRAD_HTTP_MAX_CONNECTIONS", self.loop.time())
            transport.close()
            return
        self._arm_deadline()
        source = guard.source(self.client)
        if source is None:
            return
        if guard.pending[source] >= guard.max_pending_per_source:
            guard.refused(
                f"{source} holds SWARMGRAD_HTTP_MAX_PENDING_PER_SOURCE waiting for their request",
                self.loop.time(),
            )
            transport.close()
            return
        guard.pending[source] += 1
        self._pending_source = source

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self._header_bytes is None or self.transport.is_closing():
            return
        self._header_bytes += len(data)
        if self._header_bytes > self.guard.max_header_bytes:
            self._cancel_deadline()
            self.transport.write(HEADERS_TOO_LARGE)
            self.transport.close()

    def on_headers_complete(self) -> None:
        self._header_bytes = None
        self._cancel_deadline()
        self._release_pending()
        super().on_headers_complete()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing() and self.timeout_keep_alive_task is not None:
            self._arm_deadline()  # the next request's headers, however slowly they come

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_deadline()
        self._release_pending()
        super().connection_lost(exc)

    def _arm_deadline(self) -> None:
        self._cancel_deadline()
        self._header_bytes = 0
        self._deadline = self.loop.call_later(self.guard.header_timeout_s, self._headers_late)

    def _cancel_deadline(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _release_pending(self) -> None:
        source, self._pending_source = self._pending_source, None
        if source is not None:
            self.guard.pending[source] -= 1
            if self.guard.pending[source] <= 0:
                del self.guard.pending[source]

    def _headers_late(self) -> None:
        self._deadline = None
        if not self.transport.is_closing():
            self.transport.close()


def guarded_protocol(guard: ConnectionGuard) -> type[asyncio.Protocol]:
    """What to pass as uvicorn's ``http``: :class:`GuardedHttpToolsProtocol` bound to
    ``guard``."""
    # uvicorn types ``http`` as a protocol class but only calls it, with the arguments of
    # HttpToolsProtocol: the class with ``guard`` bound stands in for it.
    return cast(type[asyncio.Protocol], functools.partial(GuardedHttpToolsProtocol, guard=guard))
