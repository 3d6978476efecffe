"""Reaching peers through a relay, and being reached through one: the peers' side of
:mod:`peer.transport.relay_server`.

A relay is ``relay://host:port``; a peer registered with it is dialed at
``relay://host:port/<peer id>`` (:func:`relay_address`), an address like any other in its
membership record. :class:`RelayTransport` wraps the node's transport: ``relay://``
addresses go through the relay, everything else to the wrapped transport. Over the relay's
circuit the link is the ordinary one (WebSocket, the node's handshake, sealed messages), so
the relay sees sizes and timing only. Bulk lanes do not run over relays: such a link sends
its tensor frames over the link itself (:mod:`peer.transport.bulk`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import urllib.parse
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from peer.exceptions import MalformedFrame, RelayRefused, TransportError
from peer.formats.identity import Authenticator, CertificateAuth, Identity, is_peer_id
from peer.transport.base import Connection, Handler, Listener, Transport
from peer.transport.relay_protocol import (
    ACCEPT,
    CHALLENGE,
    DIAL,
    HELLO,
    INCOMING,
    LISTEN,
    NOTICE,
    OK,
    PING,
    PONG,
    REFUSED,
    VERSION,
    ControlFields,
    ControlReader,
    encode_control,
    hello_payload,
)
from peer.transport.websocket import WebSocketTransport

logger = logging.getLogger("peer.transport.relay")

__all__ = ["RelayAddress", "RelayTransport", "is_relayed", "parse_relay_address", "relay_address"]

SCHEME = "relay"
_RETRY_FIRST = 1.0  # seconds before registering again after a loss, doubling ...
_RETRY_MAX = 60.0  # ... up to this
# a relay pings its registered peers every 20 s: one silent for this long is gone (a host
# that vanished without closing its connections), and the peer registers again
_SILENCE = 75.0


@dataclass(frozen=True, slots=True)
class RelayAddress:
    host: str
    port: int
    peer_id: str | None  # None: the relay itself

    @property
    def relay(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{SCHEME}://{host}:{self.port}"


def is_relayed(address: str) -> bool:
    """Whether ``address`` is reached through a relay."""
    return address.startswith(f"{SCHEME}://")


def parse_relay_address(address: str) -> RelayAddress:
    """``relay://host:port`` or ``relay://host:port/<peer id>``; ``ValueError`` otherwise."""
    parsed = urllib.parse.urlsplit(address)
    try:
        port = parsed.port
    except ValueError:
        port = None
    if parsed.scheme != SCHEME or not parsed.hostname or port is None:
        raise ValueError(f"a relay address is relay://host:port[/peer id], not {address!r}")
    path = parsed.path.strip("/")
    if path and not is_peer_id(path):
        raise ValueError(f"{address!r} does not end with a peer id")
    if parsed.query or parsed.fragment:
        raise ValueError(f"a relay address has no query or fragment: {address!r}")
    return RelayAddress(parsed.hostname, port, path or None)


def relay_address(relay: str, peer_id: str) -> str:
    """The address at which ``peer_id``, registered with ``relay``, is dialed."""
    return f"{parse_relay_address(relay).relay}/{peer_id}"


class _Greeting:
    """One connection to a relay up to its ``ok``, on a raw non-blocking socket, reading
    exactly each control message (after ``ok`` the stream belongs to the link)."""

    def __init__(self, sock: socket.socket, where: str) -> None:
        self.sock = sock
        self.where = where
        self.loop = asyncio.get_running_loop()

    async def read(self) -> tuple[str, ControlFields]:
        parser = ControlReader()
        while True:
            want = parser.needed()
            data = bytearray()
            while len(data) < want:
                chunk = await self.loop.sock_recv(self.sock, want - len(data))
                if not chunk:
                    raise TransportError(f"relay {self.where} closed the connection")
                data += chunk
            message = parser.feed(bytes(data))
            if message is not None:
                return message

    async def send(self, message: bytes) -> None:
        await self.loop.sock_sendall(self.sock, message)


async def open_relay_connection(
    relay: RelayAddress,
    *,
    identity: Identity,
    certificate: bytes,
    kind: str,
    arg: bytes = b"",
    timeout: float,
) -> tuple[socket.socket, _Greeting]:
    """A connection to ``relay`` that it accepted for ``kind`` (``listen``, ``dial`` with a
    peer id, ``accept`` with a ticket). :class:`~peer.exceptions.RelayRefused` with the
    relay's reason, :class:`~peer.exceptions.TransportError` when it cannot be reached."""
    loop = asyncio.get_running_loop()
    where = relay.relay
    sock: socket.socket | None = None
    try:
        async with asyncio.timeout(timeout):
            infos = await loop.getaddrinfo(relay.host, relay.port, type=socket.SOCK_STREAM)
            family, kind_, proto, _, target = infos[0]
            sock = socket.socket(family, kind_, proto)
            sock.setblocking(False)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            await loop.sock_connect(sock, target)
            greeting = _Greeting(sock, where)
            message_type, fields = await greeting.read()
            if message_type != CHALLENGE or fields["v"] != VERSION:
                raise MalformedFrame(f"relay {where} speaks another protocol version")
            signature = identity.sign(hello_payload(fields["nonce"], kind, arg))
            hello = encode_control(
                HELLO, kind=kind, key=identity.public_key, cert=certificate, sig=signature, arg=arg
            )
            await greeting.send(hello)
            message_type, fields = await greeting.read()
    except (OSError, TimeoutError, MalformedFrame) as exc:
        if sock is not None:
            sock.close()
        raise TransportError(f"cannot reach relay {where}: {exc or type(exc).__name__}") from None
    except BaseException:
        if sock is not None:
            sock.close()
        raise
    if message_type != OK:
        sock.close()
        reason = fields.get("reason", message_type) if message_type == REFUSED else message_type
        raise RelayRefused(f"relay {where} refused: {reason}")
    return sock, greeting


def _certificate(auth: Authenticator) -> bytes:
    if not isinstance(auth, CertificateAuth):
        raise TransportError(
            f"relays carry runs with certificates only; this node authenticates with {auth.mode!r}"
        )
    return auth.certificate


class _Registration:
    """This node's control connection to one relay, kept open; serves what it announces."""

    def __init__(self, owner: RelayTransport, relay: RelayAddress, handler: Handler) -> None:
        self.owner = owner
        self.relay = relay
        self.handler = handler
        self.registered = asyncio.Event()
        self.attempted = asyncio.Event()  # the first registration succeeded or failed
        self.last_error = ""
        self._tasks: set[asyncio.Task[Any]] = set()

    async def run(self) -> None:
        wait = _RETRY_FIRST
        while True:
            sock: socket.socket | None = None
            try:
                sock, greeting = await open_relay_connection(
                    self.relay,
                    identity=self.owner.identity,
                    certificate=_certificate(self.owner.auth()),
                    kind=LISTEN,
                    timeout=self.owner.timeout,
                )
                self.registered.set()
                self.attempted.set()
                self.last_error = ""
                wait = _RETRY_FIRST
                logger.info("registered with relay %s", self.relay.relay)
                await self._serve(greeting)
            except (TransportError, MalformedFrame) as exc:
                if str(exc) != self.last_error:
                    logger.warning("relay %s: %s (trying again)", self.relay.relay, exc)
                self.last_error = str(exc)
                self.attempted.set()
            finally:
                self.registered.clear()
                if sock is not None:
                    sock.close()
            await asyncio.sleep(wait)
            wait = min(wait * 2, _RETRY_MAX)

    async def _serve(self, greeting: _Greeting) -> None:
        while True:
            try:
                async with asyncio.timeout(_SILENCE):
                    message_type, fields = await greeting.read()
            except TimeoutError:
                raise TransportError(
                    f"relay {self.relay.relay} said nothing for {_SILENCE:g} s"
                ) from None
            if message_type == PING:
                await greeting.send(encode_control(PONG))
            elif message_type == INCOMING:
                task = asyncio.get_running_loop().create_task(
                    self._accept(fields["ticket"], fields["from"])
                )
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)
            elif message_type == NOTICE:
                logger.warning("relay %s: %s", self.relay.relay, fields["text"])
            else:
                raise MalformedFrame(f"relay {self.relay.relay} sent {message_type!r}")

    async def _accept(self, ticket: bytes, dialer: str) -> None:
        """Open the circuit ``dialer`` asked for and serve it like an accepted connection."""
        try:
            sock, _ = await open_relay_connection(
                self.relay,
                identity=self.owner.identity,
                certificate=_certificate(self.owner.auth()),
                kind=ACCEPT,
                arg=ticket,
                timeout=self.owner.timeout,
            )
        except TransportError as exc:
            logger.info(
                "could not take a circuit from %s via %s: %s", dialer, self.relay.relay, exc
            )
            return
        label = f"{self.relay.relay}/{dialer}" if is_peer_id(dialer) else self.relay.relay
        await self.owner.inner.serve_socket(sock, label, self.handler)

    async def close(self) -> None:
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


class _RelayListener(Listener):
    def __init__(self, local: Listener | None, registrations: list[_Registration]) -> None:
        self.local = local
        self.registrations = registrations
        self._tasks = [asyncio.get_running_loop().create_task(r.run()) for r in registrations]
        self.addresses = list(local.addresses if local else ())

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await asyncio.gather(*(r.close() for r in self.registrations), return_exceptions=True)
        if self.local is not None:
            await self.local.close()


class RelayTransport(Transport):
    """A WebSocket transport that also dials ``relay://`` addresses and, given ``relays``,
    is reachable through them.

    ``identity`` and ``auth`` (a callable: the node's current authenticator, so a renewed
    certificate is used at the next registration) authenticate this node to relays, which
    serve runs with certificates only. With ``listen_locally=False`` the node listens
    through its relays only (its addresses are the relay addresses).

    When the node listens it registers with each relay (a control connection, kept open,
    renewed with the node's current certificate after a loss, with a growing wait), and its
    listener's addresses include the relay addresses. When a relay says someone dials, the
    node opens the circuit's second connection and serves it like one its own listener
    accepted (the same handler, the same handshake bounds). A relay's refusal is logged with
    its reason and registration is tried again later."""

    def __init__(
        self,
        inner: WebSocketTransport,
        *,
        identity: Identity,
        auth: Callable[[], Authenticator],
        relays: Sequence[str] = (),
        listen_locally: bool = True,
        timeout: float = 10.0,
    ) -> None:
        if isinstance(relays, str):
            raise TypeError('relays is a list, e.g. ["relay://relay.example:4100"]')
        self.inner = inner
        self.identity = identity
        self.auth = auth
        self.relays = [parse_relay_address(r) for r in relays]
        if any(r.peer_id is not None for r in self.relays):
            raise ValueError("a relay to register with is relay://host:port, without a peer id")
        self.listen_locally = listen_locally
        self.timeout = timeout
        self.listener: _RelayListener | None = None

    @property
    def supports_bulk_lanes(self) -> bool:  # type: ignore[override]
        return self.inner.supports_bulk_lanes

    @property
    def max_message_bytes(self) -> int:
        return self.inner.max_message_bytes

    def relay_addresses(self) -> list[str]:
        """The addresses at which this node is dialed through its relays."""
        return [f"{r.relay}/{self.identity.peer_id}" for r in self.relays]

    async def connect(self, address: str, *, timeout: float) -> Connection:
        if not is_relayed(address):
            return await self.inner.connect(address, timeout=timeout)
        try:
            relay = parse_relay_address(address)
        except ValueError as exc:
            raise TransportError(str(exc)) from None
        if relay.peer_id is None:
            raise TransportError(
                f"{address} names a relay, not a peer: relay://host:port/<peer id>"
            )
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        sock, _ = await open_relay_connection(
            relay,
            identity=self.identity,
            certificate=_certificate(self.auth()),
            kind=DIAL,
            arg=relay.peer_id.encode("ascii"),
            timeout=timeout,
        )
        left = max(0.1, deadline - loop.time())
        return await self.inner.connect_socket(sock, address, timeout=left)

    async def listen(self, host: str, port: int, handler: Handler) -> Listener:
        local = await self.inner.listen(host, port, handler) if self.listen_locally else None
        registrations = [_Registration(self, relay, handler) for relay in self.relays]
        listener = _RelayListener(local, registrations)
        listener.addresses += self.relay_addresses()
        self.listener = listener
        if registrations:
            # the first registration (or refusal) before the node announces its addresses;
            # a relay that is away or refused is tried again in the background
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.timeout):
                    await asyncio.gather(*(r.attempted.wait() for r in registrations))
        return listener

    @property
    def registered(self) -> list[str]:
        """The relays this node is registered with right now."""
        if self.listener is None:
            return []
        return [r.relay.relay for r in self.listener.registrations if r.registered.is_set()]
