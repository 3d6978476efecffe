"""WebSocket transport (the ``websockets`` package, asyncio implementation)."""

from __future__ import annotations

import asyncio
import contextlib

from websockets.asyncio.client import connect as ws_connect
from websockets.asyncio.server import ServerConnection
from websockets.asyncio.server import serve as ws_serve
from websockets.exceptions import ConnectionClosed as WsConnectionClosed
from websockets.exceptions import InvalidHandshake, InvalidURI
from websockets.protocol import State

from peer.exceptions import ConnectionClosed, MalformedFrame, TransportError
from peer.transport.base import (
    PRE_AUTH_MESSAGE_BYTES,
    Connection,
    Handler,
    Listener,
    Message,
    Transport,
)

# RFC 6455 close codes we use: 1000 normal, 1002 protocol error, 1008 policy violation.
_NORMAL, _PROTOCOL_ERROR = 1000, 1002
_QUEUE = 64  # frames received ahead of the reader on an authenticated link
_PRE_AUTH_QUEUE = 2  # ... and before: a handshake reads one message at a time


class WebSocketConnection(Connection):
    def __init__(self, ws, remote_address: str) -> None:
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


class _WebSocketListener(Listener):
    def __init__(self, server, addresses: list[str]) -> None:
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
        try:
            ws = await asyncio.wait_for(
                ws_connect(
                    address,
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
