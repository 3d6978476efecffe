"""WebSocket transport (the ``websockets`` package, asyncio implementation)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from collections.abc import Awaitable, Callable

from websockets.asyncio.client import connect as ws_connect
from websockets.asyncio.connection import Connection as WsConnection
from websockets.asyncio.server import Server, ServerConnection
from websockets.asyncio.server import serve as ws_serve
from websockets.exceptions import ConnectionClosed as WsConnectionClosed
from websockets.exceptions import InvalidHandshake, InvalidURI
from websockets.http11 import SERVER, Request, Response
from websockets.protocol import State
from websockets.server import ServerProtocol

from peer.exceptions import ConnectionClosed, MalformedFrame, TransportError
from peer.transport.base import (
    PRE_AUTH_MESSAGE_BYTES,
    Connection,
    Handler,
    Listener,
    Message,
    Transport,
    source_of,
)

logger = logging.getLogger("peer.transport.websocket")

# RFC 6455 close codes we use: 1000 normal, 1002 protocol error, 1008 policy violation.
_NORMAL, _PROTOCOL_ERROR = 1000, 1002
_QUEUE = 64  # frames received ahead of the reader on an authenticated link
# inbound connections in their opening handshake (HTTP upgrade), in all and from one source
MAX_OPENING = 256
MAX_OPENING_PER_SOURCE = 32
_PRE_AUTH_QUEUE = 2  # ... and before: a handshake reads one message at a time


class WebSocketConnection(Connection):
    def __init__(self, ws: WsConnection, remote_address: str) -> None:
        self._ws = ws
        self.remote_address = remote_address

    async def send(self, message: Message) -> None:
        try:
            if isinstance(message, bytes | bytearray | memoryview):
                await self._ws.send(message)
            else:
                # Fragments of one message: the receiver sees a single binary message.
                await self._ws.send(list(message))
        except WsConnectionClosed as exc:
            raise ConnectionClosed(self._describe(exc), clean=exc.rcvd is not None) from None

    async def recv(self) -> bytes:
        try:
            data = await self._ws.recv()
        except WsConnectionClosed as exc:
            raise ConnectionClosed(self._describe(exc), clean=exc.rcvd is not None) from None
        if isinstance(data, str):
            raise MalformedFrame("text messages are not part of the protocol; send binary frames")
        return data

    async def close(self, reason: str = "", *, protocol_error: bool = False) -> None:
        code = _PROTOCOL_ERROR if protocol_error else _NORMAL
        # A close reason travels in one control frame: at most 123 bytes of UTF-8.
        reason_bytes = reason.encode("utf-8")[:123]
        await self._ws.close(code, reason_bytes.decode("utf-8", "ignore"))

    @property
    def closed(self) -> bool:
        return self._ws.state is State.CLOSED or self._ws.state is State.CLOSING

    @property
    def close_reason(self) -> str:
        rcvd = self._ws.protocol.close_rcvd
        return rcvd.reason if rcvd is not None else ""

    def limit_incoming(self, max_bytes: int) -> None:
        # read by the parser at the start of every message
        self._ws.protocol.max_message_size = max_bytes
        # Before authentication a few frames may wait to be read, not the 64 of a link:
        # reading pauses past them (the sender meets TCP's backpressure), so a stranger
        # cannot park megabytes of small messages in a handshake that never reads them.
        queue = self._ws.recv_messages
        queue.high, queue.low = (
            (_QUEUE, _QUEUE // 4) if max_bytes > PRE_AUTH_MESSAGE_BYTES else (_PRE_AUTH_QUEUE, 0)
        )

    @staticmethod
    def _describe(exc: WsConnectionClosed) -> str:
        frame = exc.rcvd or exc.sent
        if frame is None:
            return "connection lost"
        return f"connection closed ({frame.code}{': ' + frame.reason if frame.reason else ''})"


class _Openings:
    """Connections still in their opening handshake (the HTTP upgrade, before the node's own
    handshake sees them), by source (:func:`~peer.transport.base.source_of`): at most
    ``total`` at once and ``per_source`` from one source; more are dropped as they are
    accepted, so connections that never finish opening cannot take the process's file
    descriptors (each one waits ``open_timeout`` at most)."""

    def __init__(self, total: int, per_source: int) -> None:
        self.total = total
        self.per_source = per_source
        self.by_source: dict[str, int] = {}
        self._warned: set[str] = set()

    def admit(self, source: str) -> bool:
        waiting = self.by_source.get(source, 0)
        if waiting < self.per_source and sum(self.by_source.values()) < self.total:
            self.by_source[source] = waiting + 1
            return True
        if source not in self._warned:
            if len(self._warned) >= 1024:
                self._warned.clear()  # bounded, whatever the sources
            self._warned.add(source)
            logger.warning(
                "refusing WebSocket connections from %s: %d of its connections are still opening",
                source,
                waiting,
            )
        return False

    def release(self, source: str) -> None:
        left = self.by_source.get(source, 0) - 1
        if left > 0:
            self.by_source[source] = left
        else:
            self.by_source.pop(source, None)


def _guarded_connection(openings: _Openings) -> type[ServerConnection]:
    class GuardedConnection(ServerConnection):
        _source = ""
        _opening = False

        def connection_made(self, transport: asyncio.BaseTransport) -> None:
            super().connection_made(transport)
            peer = transport.get_extra_info("peername")
            self._source = source_of(str(peer[0])) if peer else "?"
            self._opening = openings.admit(self._source)
            if not self._opening:
                transport.abort()  # type: ignore[attr-defined]

        def _opened(self) -> None:
            if self._opening:
                self._opening = False
                openings.release(self._source)

        async def handshake(
            self,
            process_request: Callable[
                [ServerConnection, Request], Awaitable[Response | None] | Response | None
            ]
            | None = None,
            process_response: Callable[
                [ServerConnection, Request, Response], Awaitable[Response | None] | Response | None
            ]
            | None = None,
            server_header: str | None = SERVER,
        ) -> None:
            try:
                await super().handshake(process_request, process_response, server_header)
            finally:
                self._opened()

        def connection_lost(self, exc: Exception | None) -> None:
            self._opened()
            super().connection_lost(exc)

    return GuardedConnection


async def _no_listener() -> asyncio.Server:
    raise RuntimeError("a connection served alone has no listener")


class _OneConnection(Server):
    """The ``websockets`` server of one connection that no listener accepted (a relay's
    circuit, :meth:`WebSocketTransport.serve_socket`): serving while it lasts."""

    def is_serving(self) -> bool:
        return True


class _WebSocketListener(Listener):
    def __init__(self, server: Server, addresses: list[str]) -> None:
        self._server = server
        self.addresses = addresses

    async def close(self) -> None:
        self._server.close()
        with contextlib.suppress(Exception):
            await self._server.wait_closed()


class WebSocketTransport(Transport):
    """Plain ``ws://`` transport. ``max_message_bytes`` bounds what a peer may send us in one
    message; the library's frame limits are derived from the same number."""

    def __init__(self, *, max_message_bytes: int, open_timeout: float = 10.0) -> None:
        self._max = max_message_bytes
        self._open_timeout = open_timeout

    supports_bulk_lanes = True

    @property
    def max_message_bytes(self) -> int:
        return self._max

    async def connect(self, address: str, *, timeout: float) -> Connection:
        return await self._connect(address, address, timeout, sock=None)

    async def connect_socket(
        self, sock: socket.socket, address: str, *, timeout: float
    ) -> Connection:
        """Open a WebSocket connection over ``sock``, a TCP stream already connected to the
        other side (a relay's circuit, :mod:`peer.transport.relay`); ``address`` is what the
        connection reports as its remote address. The socket is the connection's from now
        on, closed with it (or here, on failure)."""
        try:
            return await self._connect("ws://relayed/", address, timeout, sock=sock)
        except BaseException:
            sock.close()
            raise

    async def _connect(
        self, uri: str, address: str, timeout: float, *, sock: socket.socket | None
    ) -> Connection:
        try:
            ws = await asyncio.wait_for(
                ws_connect(
                    uri,
                    sock=sock,
                    max_size=self._max,
                    compression=None,
                    ping_interval=20,
                    ping_timeout=20,
                    close_timeout=2,
                    max_queue=_QUEUE,
                    open_timeout=None,
                ),
                timeout,
            )
        except (OSError, InvalidHandshake, InvalidURI, TimeoutError) as exc:
            raise TransportError(
                f"cannot connect to {address}: {exc or type(exc).__name__}"
            ) from None
        connection = WebSocketConnection(ws, address)
        connection.limit_incoming(min(self._max, PRE_AUTH_MESSAGE_BYTES))
        return connection

    async def serve_socket(
        self, sock: socket.socket, remote_address: str, handler: Handler
    ) -> None:
        """Serve one WebSocket connection whose TCP stream is already open on ``sock`` (the
        dialed side of a relay's circuit) with ``handler``, as :meth:`listen` serves each
        connection it accepts; returns once the handler has and the connection is closed.
        ``remote_address`` is what the connection reports as its remote address."""
        loop = asyncio.get_running_loop()
        served: asyncio.Future[None] = loop.create_future()

        async def run(ws: ServerConnection) -> None:
            try:
                async with asyncio.timeout(self._open_timeout):
                    await ws.handshake()
                if ws.protocol.state is not State.OPEN:
                    ws.transport.abort()
                    return
                ws.start_keepalive()
                async with ws:
                    connection = WebSocketConnection(ws, remote_address)
                    connection.limit_incoming(min(self._max, PRE_AUTH_MESSAGE_BYTES))
                    await handler(connection)
            except Exception as exc:  # as websockets' own server: log, never leak the socket
                logger.debug("relayed connection from %s failed: %s", remote_address, exc)
                ws.transport.abort()
            finally:
                if not served.done():
                    served.set_result(None)

        server = _OneConnection(_no_listener, run)

        def connection() -> ServerConnection:
            return ServerConnection(
                ServerProtocol(max_size=self._max),
                server,
                ping_interval=20,
                ping_timeout=20,
                close_timeout=2,
                max_queue=_QUEUE,
            )

        try:
            await loop.connect_accepted_socket(connection, sock)
        except BaseException:
            sock.close()
            raise
        try:
            await asyncio.shield(served)
        except asyncio.CancelledError:
            tasks = list(server.handler_tasks)
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            raise

    def _openings(self) -> _Openings:
        return _Openings(MAX_OPENING, MAX_OPENING_PER_SOURCE)

    async def listen(self, host: str, port: int, handler: Handler) -> Listener:
        async def on_connection(ws: ServerConnection) -> None:
            remote = ws.remote_address
            label = "ws://?"
            if remote:  # an IPv6 host goes in brackets, as in any URL
                host = f"[{remote[0]}]" if ":" in remote[0] else remote[0]
                label = f"ws://{host}:{remote[1]}"
            connection = WebSocketConnection(ws, label)
            # until the handshake raises it, no peer makes us buffer a large message
            connection.limit_incoming(min(self._max, PRE_AUTH_MESSAGE_BYTES))
            await handler(connection)

        server = await ws_serve(
            on_connection,
            host,
            port,
            create_connection=_guarded_connection(self._openings()),
            open_timeout=self._open_timeout,
            max_size=self._max,
            compression=None,
            ping_interval=20,
            ping_timeout=20,
            close_timeout=2,
            max_queue=_QUEUE,
        )
        addresses = []
        for sock in server.sockets:
            sock_host, sock_port = sock.getsockname()[:2]
            if ":" in sock_host:
                sock_host = f"[{sock_host}]"
            addresses.append(f"ws://{sock_host}:{sock_port}")
        return _WebSocketListener(server, addresses)
