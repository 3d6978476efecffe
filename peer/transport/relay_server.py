"""The relay server: splices TCP streams between peers of a run that cannot dial each other.

Authenticated peers of a run register (a control connection each) and are dialed by other
authenticated peers of the same run by peer id; the relay copies bytes between the dialer's
connection and the one the dialed peer opens for the circuit, and nothing else (the protocol
and its checks are :mod:`peer.transport.relay_protocol`). It never connects anywhere itself,
and what it carries is sealed end to end (:mod:`peer.transport.secure`): it learns sizes and
timing, and a byte it altered would fail authentication at the peer. ``swarmgrad relay``
runs one (:class:`RelayServer`). Not a TURN server: TURN relays UDP and few clients support
its TCP allocations, while links here are TCP streams authenticated with run certificates,
which TURN cannot check.

Limits (:class:`~peer.transport.relay_protocol.RelayLimits`): peers registered, circuits in
all and per account, each account's rate and bytes per window; connections still in their
opening are bounded in all and per source, each for ``handshake_timeout``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any, TypeVar

from peer.exceptions import AuthenticationError, MalformedFrame, RelayRefused
from peer.formats.identity import (
    Certificate,
    CertificateVerifier,
    peer_id_from_public_key,
    verify_signature,
)
from peer.transport.base import source_of
from peer.transport.relay_protocol import (
    CHALLENGE,
    DIAL,
    HELLO,
    INCOMING,
    LISTEN,
    NONCE_BYTES,
    NOTICE,
    OK,
    PING,
    PONG,
    REFUSED,
    VERSION,
    Circuit,
    ControlFields,
    ControlReader,
    Party,
    RelayBook,
    RelayLimits,
    check_hello,
    encode_control,
    hello_payload,
)

logger = logging.getLogger("peer.transport.relay")

T = TypeVar("T")

__all__ = ["RelayServer", "RunKeys", "StaticRunKeys"]

RunKeys = Callable[[str], Awaitable[bytes | None]]
"""``await keys(run_id)``: the run authority's public key, or None for a run this relay does
not serve."""

CHUNK = 256 << 10  # bytes read from one side of a circuit at a time
MAX_OPENING = 256  # connections in their challenge and hello, in all ...
MAX_OPENING_PER_SOURCE = 32  # ... and from one source


@dataclass(frozen=True)
class StaticRunKeys:
    """The runs a relay serves, given in its configuration: run id → authority public key."""

    keys: dict[str, bytes] = field(default_factory=dict)

    async def __call__(self, run_id: str) -> bytes | None:
        return self.keys.get(run_id)


async def read_control(reader: asyncio.StreamReader) -> tuple[str, ControlFields]:
    """The next control message on ``reader``, reading exactly its bytes."""
    parser = ControlReader()
    while True:
        message = parser.feed(await reader.readexactly(parser.needed()))
        if message is not None:
            return message


@dataclass(eq=False)
class _Control:
    """A registered peer's control connection."""

    party: Party
    writer: asyncio.StreamWriter
    pong_at: float

    def send(self, message: bytes) -> None:
        if not self.writer.is_closing():
            self.writer.write(message)


@dataclass(eq=False)
class _Side:
    reader: asyncio.StreamReader
    writer: asyncio.StreamWriter
    party: Party


class RelayServer:
    """A relay listening on ``host``:``port`` (0: any free port) for the runs ``keys`` knows.

    ``await start()``, then peers reach it at :attr:`address` (``relay://host:port``; a
    peer registered there is dialed at ``relay://host:port/<peer id>``); ``await close()``
    ends every connection. :meth:`stats` says what it carries. ``public_address`` is the
    address to tell peers when the listening one is not theirs to dial (a wildcard host, a
    port forwarded elsewhere)."""

    def __init__(
        self,
        keys: RunKeys,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        limits: RelayLimits | None = None,
        public_address: str | None = None,
        handshake_timeout: float = 10.0,
        ping_interval: float = 20.0,
        max_clock_skew: float = 5.0,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.keys = keys
        self.host = host
        self.port = port
        self.book = RelayBook(limits)
        self.public_address = public_address
        self.handshake_timeout = handshake_timeout
        self.ping_interval = ping_interval
        self.max_clock_skew = max_clock_skew
        self.clock = clock
        self._server: asyncio.Server | None = None
        self._controls: dict[str, _Control] = {}  # peer id → its control connection
        self._waiting: dict[bytes, asyncio.Future[_Side]] = {}  # ticket → its acceptor
        self._opening: dict[str, int] = {}  # source → connections in their hello
        self._tasks: set[asyncio.Task[Any]] = set()
        self._writers: set[asyncio.StreamWriter] = set()

    @property
    def address(self) -> str:
        """Where peers reach this relay: ``relay://host:port``."""
        if self.public_address:
            return self.public_address
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"relay://{host}:{self.port}"

    def stats(self) -> dict[str, int]:
        """Peers registered, circuits, bytes carried (both directions, all circuits so far)."""
        return self.book.stats()

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._on_connection, self.host, self.port)
        self.port = self._server.sockets[0].getsockname()[1]
        self._spawn(self._maintenance())
        logger.info("relay listening at %s", self.address)

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        for writer in list(self._writers):
            writer.close()
        tasks = [t for t in self._tasks if t is not asyncio.current_task()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self._server is not None:
            with contextlib.suppress(Exception):
                await self._server.wait_closed()

    async def __aenter__(self) -> RelayServer:
        await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    def carry(self, circuit: Circuit, sender: Party, data: bytes) -> bytes:
        """The bytes ``sender`` sent over ``circuit``, as they go on to the other side: the
        same. (The attack tests override this with a relay that alters them.)"""
        return data

    # connections ---------------------------------------------------------------------------

    def _spawn(self, coro: Coroutine[object, object, T]) -> asyncio.Task[T]:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def _on_connection(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        task = asyncio.current_task()
        assert task is not None  # a connection's handler runs as a task
        self._tasks.add(task)  # close() cancels it
        self._writers.add(writer)
        peer = writer.get_extra_info("peername")
        source = source_of(str(peer[0])) if peer else "?"
        try:
            party, kind, arg = await self._opening_of(reader, writer, source)
            if party is None:
                return
            if kind == LISTEN:
                await self._serve_control(party, reader, writer)
            elif kind == DIAL:
                await self._serve_dial(party, arg.decode("ascii"), reader, writer)
            else:
                await self._serve_accept(party, arg, reader, writer)
        except (ConnectionError, asyncio.IncompleteReadError, OSError) as exc:
            logger.debug("relay connection from %s ended: %s", source, exc)
        finally:
            self._writers.discard(writer)
            writer.close()
            self._tasks.discard(task)

    async def _opening_of(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, source: str
    ) -> tuple[Party | None, str, bytes]:
        """The challenge and hello of a new connection: who it is and what it asks (a None
        party when it was refused, or said nothing in time)."""
        waiting = self._opening.get(source, 0)
        if waiting >= MAX_OPENING_PER_SOURCE or sum(self._opening.values()) >= MAX_OPENING:
            logger.debug("refusing a relay connection from %s: too many opening", source)
            return None, "", b""
        self._opening[source] = waiting + 1
        try:
            nonce = os.urandom(NONCE_BYTES)
            writer.write(encode_control(CHALLENGE, nonce=nonce, v=VERSION))
            async with asyncio.timeout(self.handshake_timeout):
                message_type, fields = await read_control(reader)
                if message_type != HELLO:
                    raise MalformedFrame(
                        f"a relay connection starts with hello, not {message_type}"
                    )
                check_hello(fields)
                party = await self._authenticate(fields, nonce)
        except (MalformedFrame, AuthenticationError, RelayRefused) as exc:
            logger.info("relay refused a connection from %s: %s", source, exc)
            self.book.refusals += 1
            writer.write(encode_control(REFUSED, reason=str(exc)))
            with contextlib.suppress(ConnectionError):
                await writer.drain()
            return None, "", b""
        except TimeoutError:
            logger.debug("a relay connection from %s said nothing in time", source)
            return None, "", b""
        finally:
            left = self._opening[source] - 1
            if left:
                self._opening[source] = left
            else:
                del self._opening[source]
        return party, fields["kind"], fields["arg"]

    async def _authenticate(self, fields: ControlFields, nonce: bytes) -> Party:
        """The peer a hello proves (its certificate is one of a run this relay serves, issued
        to the key that signed this connection's nonce)."""
        certificate = Certificate.from_bytes(fields["cert"])
        run_key = await self.keys(certificate.run_id)
        if run_key is None:
            raise AuthenticationError(f"this relay does not serve run {certificate.run_id!r}")
        verify = CertificateVerifier(
            run_key, certificate.run_id, max_clock_skew=self.max_clock_skew, clock=self.clock
        )
        verify(fields["cert"], fields["key"])
        payload = hello_payload(nonce, fields["kind"], fields["arg"])
        if not verify_signature(fields["key"], fields["sig"], payload):
            raise AuthenticationError("the hello's signature does not verify with its key")
        peer_id = peer_id_from_public_key(fields["key"])
        return Party(
            peer_id,
            certificate.run_id,
            certificate.volunteer or peer_id,
            certificate.expires_at + self.max_clock_skew,
        )

    def _refuse(self, writer: asyncio.StreamWriter, party: Party, exc: RelayRefused) -> None:
        logger.info("relay refused peer %s: %s", party.peer_id, exc)
        writer.write(encode_control(REFUSED, reason=str(exc)))

    # the three kinds -----------------------------------------------------------------------

    async def _serve_control(
        self, party: Party, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        try:
            previous = self.book.register(party, self.clock())
        except RelayRefused as exc:
            self._refuse(writer, party, exc)
            await writer.drain()
            return
        if previous is not None:
            old = self._controls.pop(previous.peer_id, None)
            if old is not None:
                old.writer.close()
        control = _Control(party, writer, asyncio.get_running_loop().time())
        self._controls[party.peer_id] = control
        writer.write(encode_control(OK))
        logger.info("peer %s registered (run %s)", party.peer_id, party.run_id)
        try:
            while True:
                message_type, _ = await read_control(reader)
                if message_type != PONG:
                    raise MalformedFrame(f"a control connection sends pong, not {message_type}")
                control.pong_at = asyncio.get_running_loop().time()
        except MalformedFrame as exc:
            logger.info("closing the control connection of %s: %s", party.peer_id, exc)
        finally:
            if self._controls.get(party.peer_id) is control:
                del self._controls[party.peer_id]
            self.book.unregister(party)

    async def _serve_dial(
        self,
        party: Party,
        target: str,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
    ) -> None:
        book = self.book
        try:
            circuit = book.dial(party, target, self.clock())
        except RelayRefused as exc:
            self._refuse(writer, party, exc)
            await writer.drain()
            return
        accepted: asyncio.Future[_Side] = asyncio.get_running_loop().create_future()
        self._waiting[circuit.ticket] = accepted
        try:
            control = self._controls.get(target)
            if control is not None:
                control.send(
                    encode_control(INCOMING, ticket=circuit.ticket, **{"from": party.peer_id})
                )
            try:
                async with asyncio.timeout(book.limits.accept_timeout):
                    other = await accepted
            except TimeoutError:
                self._refuse(
                    writer,
                    party,
                    RelayRefused(
                        f"peer {target} did not answer through the relay within "
                        f"{book.limits.accept_timeout:g} s"
                    ),
                )
                await writer.drain()
                return
            writer.write(encode_control(OK))
            await self._splice(circuit, _Side(reader, writer, party), other)
        finally:
            self._waiting.pop(circuit.ticket, None)
            book.close(circuit)
            if accepted.done() and not accepted.cancelled():
                # the accepting side's task waits for this (also when it came too late)
                accepted.result().writer.close()

    async def _serve_accept(
        self,
        party: Party,
        ticket: bytes,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
    ) -> None:
        try:
            self.book.accept(ticket, party, self.clock())
            waiter = self._waiting.get(ticket)
            if waiter is None or waiter.done():
                raise RelayRefused("the dialer of this circuit is gone")
        except RelayRefused as exc:
            self._refuse(writer, party, exc)
            await writer.drain()
            return
        writer.write(encode_control(OK))
        waiter.set_result(_Side(reader, writer, party))
        # the dialer's task splices and closes this writer; this task waits for the close
        with contextlib.suppress(Exception):
            await writer.wait_closed()

    async def _splice(self, circuit: Circuit, a: _Side, b: _Side) -> None:
        """Copy bytes both ways until both directions ended (or a limit closed the circuit)."""
        up = asyncio.ensure_future(self._pump(circuit, a, b))
        down = asyncio.ensure_future(self._pump(circuit, b, a))
        try:
            done, _ = await asyncio.wait((up, down), return_when=asyncio.FIRST_EXCEPTION)
            for task in done:
                if task.exception() is not None:
                    raise task.exception()  # type: ignore[misc]
            await asyncio.gather(up, down)
        except RelayRefused as exc:
            for side in (a, b):
                control = self._controls.get(side.party.peer_id)
                if control is not None:
                    control.send(encode_control(NOTICE, text=f"circuit closed: {exc}"))
            logger.warning("closed the circuit %s → %s: %s", a.party.peer_id, b.party.peer_id, exc)
        except (ConnectionError, OSError) as exc:
            logger.debug("circuit %s → %s ended: %s", a.party.peer_id, b.party.peer_id, exc)
        finally:
            up.cancel()
            down.cancel()
            await asyncio.gather(up, down, return_exceptions=True)

    async def _pump(self, circuit: Circuit, src: _Side, dst: _Side) -> None:
        while True:
            # up to the sender's cap and no further (a byte past it is read, and refused)
            room = self.book.room(src.party, self.clock())
            data = await src.reader.read(min(CHUNK, max(1, room)))
            if not data:
                if dst.writer.can_write_eof():
                    with contextlib.suppress(OSError):
                        dst.writer.write_eof()
                return
            delay = self.book.charge(circuit, src.party, len(data), self.clock())
            dst.writer.write(self.carry(circuit, src.party, data))
            await dst.writer.drain()
            if delay:
                # the account's rate: read nothing more of it for a while (TCP holds it back)
                await asyncio.sleep(delay)

    # upkeep --------------------------------------------------------------------------------

    async def _maintenance(self) -> None:
        """Once a second: drop expired registrations and unanswered circuits, ping control
        connections every ``ping_interval`` and close those that stopped answering."""
        loop = asyncio.get_running_loop()
        last_ping = loop.time()
        while True:
            await asyncio.sleep(1.0)
            # circuits nobody accepted in time are dropped here; their dialers time out
            expired, _ = self.book.expire(self.clock())
            for party in expired:
                control = self._controls.pop(party.peer_id, None)
                if control is not None:
                    logger.info("peer %s's certificate expired: unregistered", party.peer_id)
                    control.send(encode_control(NOTICE, text="your certificate expired"))
                    control.writer.close()
            now = loop.time()
            if now - last_ping >= self.ping_interval:
                last_ping = now
                for control in list(self._controls.values()):
                    if now - control.pong_at > 2.5 * self.ping_interval:
                        logger.info(
                            "peer %s stopped answering: unregistered", control.party.peer_id
                        )
                        control.writer.close()
                    else:
                        control.send(encode_control(PING))
