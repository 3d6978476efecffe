"""In-memory transport: every node of a simulation in one process and one event loop.

A :class:`MemoryNetwork` connects :class:`MemoryTransport` endpoints by address
(``mem://host:port``) and can inject what real networks do to messages: latency, a
bandwidth cap (the sender is held back for the transmission time, so back-pressure is
real), random drops, partitions (messages across a cut vanish and dialing across it times out,
until it is restored) and crashes (a crashed host's connections vanish without a close
message, as after SIGKILL). Used by tests for faults and by the many-peer simulator.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import random
from collections.abc import Iterable
from dataclasses import dataclass

from peer.exceptions import ConnectionClosed, TransportError
from peer.transport.base import Connection, Handler, Listener, Message, Transport

_CLOSED = object()  # the other side closed on purpose
_LOST = object()  # the connection vanished (crash)


@dataclass
class LinkConditions:
    latency: float = 0.0  # seconds added to every message
    bandwidth: float | None = None  # bytes per second; None = unlimited
    drop_rate: float = 0.0  # probability that a message is silently lost


@dataclass
class NetworkStats:
    messages: int = 0
    bytes: int = 0
    dropped: int = 0
    connections: int = 0


class MemoryNetwork:
    def __init__(
        self,
        *,
        latency: float = 0.0,
        bandwidth: float | None = None,
        drop_rate: float = 0.0,
        seed: int | None = None,
        max_message_bytes: int = 1 << 30,
    ) -> None:
        self.default = LinkConditions(latency, bandwidth, drop_rate)
        self._links: dict[tuple[str, str], LinkConditions] = {}
        self._listeners: dict[str, _MemoryListener] = {}
        self._connections: dict[str, set[_MemoryConnection]] = {}
        self._crashed: set[str] = set()
        self._cuts: set[frozenset[str]] = set()
        self._ports = itertools.count(1)
        self._hosts = itertools.count(1)
        self.random = random.Random(seed)
        self.stats = NetworkStats()
        self.max_message_bytes = max_message_bytes

    def transport(self, host: str | None = None) -> MemoryTransport:
        """A transport for one simulated host (a fresh host name when none is given)."""
        return MemoryTransport(self, host or f"host{next(self._hosts)}")

    def set_link(
        self,
        src: str,
        dst: str,
        *,
        latency: float | None = None,
        bandwidth: float | None = None,
        drop_rate: float | None = None,
    ) -> None:
        """Conditions for messages from host ``src`` to host ``dst`` (one direction)."""
        base = self._links.get((src, dst), LinkConditions(**vars(self.default)))
        self._links[(src, dst)] = LinkConditions(
            base.latency if latency is None else latency,
            base.bandwidth if bandwidth is None else bandwidth,
            base.drop_rate if drop_rate is None else drop_rate,
        )

    def conditions(self, src: str, dst: str) -> LinkConditions:
        return self._links.get((src, dst), self.default)

    def crash(self, host: str) -> None:
        """Kill ``host`` abruptly: its listeners stop and its connections are lost without
        a close handshake; dialing it fails from now on."""
        self._crashed.add(host)
        for address in [a for a, lst in self._listeners.items() if lst.host == host]:
            del self._listeners[address]
        for conn in list(self._connections.get(host, ())):
            conn._lose()

    def is_crashed(self, host: str) -> bool:
        return host in self._crashed

    def cut(self, side_a: Iterable[str], side_b: Iterable[str]) -> None:
        """Partition: no message passes between a host of ``side_a`` and one of
        ``side_b`` (open connections stall, as TCP does; new ones time out)."""
        self._cuts.update(frozenset((a, b)) for a in side_a for b in side_b if a != b)

    def restore(self) -> None:
        """Heal every partition made by :meth:`cut`."""
        self._cuts.clear()

    def is_cut(self, a: str, b: str) -> bool:
        return frozenset((a, b)) in self._cuts

    # internal ------------------------------------------------------------------------

    def _register(self, conn: _MemoryConnection) -> None:
        self._connections.setdefault(conn.host, set()).add(conn)

    def _unregister(self, conn: _MemoryConnection) -> None:
        self._connections.get(conn.host, set()).discard(conn)


class _MemoryConnection(Connection):
    def __init__(
        self, network: MemoryNetwork, host: str, remote_host: str, remote_address: str
    ) -> None:
        self._network = network
        self.host = host
        self.remote_host = remote_host
        self.remote_address = remote_address
        self._inbox: asyncio.Queue[object] = asyncio.Queue()
        self._peer: _MemoryConnection | None = None
        self._closed = False
        self._reason = ""
        self._last_delivery = 0.0
        self._in_flight: collections.deque[tuple[float, object]] = collections.deque()
        self._pump: asyncio.TimerHandle | None = None
        self._send_lock = asyncio.Lock()
        network._register(self)

    async def send(self, message: Message) -> None:
        if self._closed or self._peer is None:
            raise ConnectionClosed(
                f"connection closed{': ' + self._reason if self._reason else ''}"
            )
        if isinstance(message, bytes | bytearray | memoryview):
            data = bytes(message)
        else:
            data = b"".join(bytes(part) for part in message)
        if len(data) > self._network.max_message_bytes:
            raise ConnectionClosed("message over the transport's size limit")
        cond = self._network.conditions(self.host, self.remote_host)
        loop = asyncio.get_running_loop()
        async with self._send_lock:
            if cond.bandwidth:
                # The link is busy for the transmission time; later sends queue behind it.
                await asyncio.sleep(len(data) / cond.bandwidth)
            if self._closed or self._peer is None:
                raise ConnectionClosed("connection closed")
            stats = self._network.stats
            if self._network.is_cut(self.host, self.remote_host) or (
                cond.drop_rate and self._network.random.random() < cond.drop_rate
            ):
                stats.dropped += 1
                return
            stats.messages += 1
            stats.bytes += len(data)
            self._deliver(data, loop.time() + cond.latency)

    def _deliver(self, item: object, at: float) -> None:
        """Queue ``item`` for the other side at time ``at``. One timer pumps the queue in
        order: timers due at the same instant have no guaranteed order in asyncio."""
        if self._peer is None:
            return
        at = max(at, self._last_delivery)
        self._last_delivery = at
        self._in_flight.append((at, item))
        if self._pump is None:
            self._pump = asyncio.get_running_loop().call_at(at, self._run_pump)

    def _run_pump(self) -> None:
        self._pump = None
        peer = self._peer
        now = asyncio.get_running_loop().time()
        while self._in_flight and self._in_flight[0][0] <= now:
            _, item = self._in_flight.popleft()
            if peer is not None:
                peer._inbox.put_nowait(item)
        if self._in_flight:
            self._pump = asyncio.get_running_loop().call_at(self._in_flight[0][0], self._run_pump)

    async def recv(self) -> bytes:
        if self._closed and self._inbox.empty():
            raise ConnectionClosed(
                f"connection closed{': ' + self._reason if self._reason else ''}"
            )
        item = await self._inbox.get()
        if item is _CLOSED or item is _LOST:
            self._inbox.put_nowait(item)  # later recv() calls fail the same way
            self._mark_closed(self._reason)
            raise ConnectionClosed(
                f"connection closed{': ' + self._reason if self._reason else ''}",
                clean=item is _CLOSED,
            )
        assert isinstance(item, bytes)
        return item

    async def close(self, reason: str = "", *, protocol_error: bool = False) -> None:
        if self._closed:
            return
        self._mark_closed(reason)
        peer = self._peer
        if peer is not None and not peer._closed:
            peer._reason = reason
            self._deliver(_CLOSED, asyncio.get_running_loop().time())
        self._inbox.put_nowait(_CLOSED)

    def _lose(self) -> None:
        """Crash: both ends see the connection vanish, immediately and without a reason."""
        for side in (self, self._peer):
            if side is not None and side._pump is not None:
                side._pump.cancel()
                side._pump = None
                side._in_flight.clear()
        for side in (self, self._peer):
            if side is not None and not side._closed:
                side._mark_closed("connection lost")
                side._inbox.put_nowait(_LOST)

    def _mark_closed(self, reason: str) -> None:
        self._closed = True
        self._reason = self._reason or reason
        self._network._unregister(self)

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def close_reason(self) -> str:
        return self._reason


class _MemoryListener(Listener):
    def __init__(self, network: MemoryNetwork, host: str, address: str, handler: Handler) -> None:
        self._network = network
        self.host = host
        self.addresses = [address]
        self.handler = handler
        self.tasks: set[asyncio.Task[None]] = set()

    async def close(self) -> None:
        self._network._listeners.pop(self.addresses[0], None)
        tasks = list(self.tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


class MemoryTransport(Transport):
    def __init__(self, network: MemoryNetwork, host: str) -> None:
        self.network = network
        self.host = host

    @property
    def max_message_bytes(self) -> int:
        return self.network.max_message_bytes

    async def connect(self, address: str, *, timeout: float) -> Connection:
        net = self.network
        if net.is_crashed(self.host):
            raise TransportError(f"{self.host} has crashed")
        listener = net._listeners.get(address)
        if listener is None:
            raise TransportError(f"cannot connect to {address}: nobody listens there")
        if net.is_cut(self.host, listener.host):
            await asyncio.sleep(timeout)
            raise TransportError(f"cannot connect to {address}: timed out")
        cond = net.conditions(self.host, listener.host)
        if cond.latency:
            await asyncio.sleep(2 * cond.latency)  # the opening handshake's round trip
        if address not in net._listeners or net.is_crashed(self.host):
            # the listener went away, or this host crashed, during the opening handshake
            raise TransportError(f"cannot connect to {address}: connection refused")
        local = _MemoryConnection(net, self.host, listener.host, address)
        remote = _MemoryConnection(net, listener.host, self.host, f"mem://{self.host}")
        local._peer, remote._peer = remote, local
        net.stats.connections += 1

        async def serve() -> None:
            try:
                await listener.handler(remote)
            finally:
                await remote.close()

        task = asyncio.get_running_loop().create_task(serve())
        listener.tasks.add(task)
        task.add_done_callback(listener.tasks.discard)
        return local

    async def listen(self, host: str, port: int, handler: Handler) -> Listener:
        if port == 0:
            port = next(self.network._ports)
        address = f"mem://{self.host}:{port}"
        if address in self.network._listeners:
            raise TransportError(f"{address} is already in use")
        listener = _MemoryListener(self.network, self.host, address, handler)
        self.network._listeners[address] = listener
        return listener
