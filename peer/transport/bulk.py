"""Bulk lanes: TCP side connections for large one-way frames (tensor parts).

A WebSocket message costs several user-space copies on each side; averaging moves the
model's size through every peer each round, so on fast links those copies bound its
throughput. A bulk lane carries the same :mod:`peer.wire` frames over a plain non-blocking
TCP socket (:mod:`peer.transport.lane_socket`): payloads go from the socket straight into a
buffer of their size, and out of the sender's tensor memory, with no copy in user space.

Trust: a lane opens only beside an authenticated link, with a single-use ticket the
listener issued over it and, with encryption (the default), a proof of the lane's keys; its
frames travel sealed (:mod:`peer.transport.lane_protocol`). Only message types registered
with :meth:`BulkLanes.accept` travel on lanes; anything else closes the lane. A peer that
cannot be reached by lane (client mode, a relayed or punched link, a firewalled port) is
reached over the link: :meth:`BulkLanes.send` never fails for lack of a lane.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import socket
import time
import urllib.parse
from collections.abc import Awaitable, Callable, Coroutine
from typing import TypeVar

from peer.exceptions import SwarmgradError, TransportError
from peer.transport.base import source_of
from peer.transport.lane_links import LaneLinks, TicketLink
from peer.transport.lane_protocol import (
    BULK_TICKET,
    CLOSED,
    Admission,
    Admitted,
    TicketBook,
    TicketOffer,
    preamble,
    register,
)
from peer.transport.lane_socket import BulkSender, SocketLane
from peer.transport.receive_buffers import BufferPool
from peer.wire import Frame, Limits, MessageRegistry

logger = logging.getLogger("peer.transport.bulk")

T = TypeVar("T")

__all__ = ["BULK_TICKET", "BulkLanes", "BulkSender"]

_RETRY_AFTER = 60.0  # seconds before trying again a lane to a peer that could not get one
_CONNECT_TIMEOUT = 3.0  # a lane port behind a firewall: fall back to the link soon
# connections to the lane port that have not shown a ticket yet (each one a file
# descriptor): in all, from one source (an IP address, an IPv6 /64), and for how long
MAX_ADMISSIONS = 128
MAX_ADMISSIONS_PER_SOURCE = 16
ADMISSION_TIMEOUT = 5.0


def _tune(sock: socket.socket) -> None:
    sock.setblocking(False)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    # socket buffers are left to the kernel's autotuning (a fixed size would turn it off)


class BulkLanes:
    """A node's bulk lanes: a listener (unless in client mode), and lanes by peer id.

    Created by a node whose transport runs over TCP, which hands itself over as ``links``.
    ``send(peer_id, frame)`` uses a lane when one exists or can be opened, the link
    otherwise. Frames received on lanes go to ``deliver(BulkSender, frame)``, the node's
    handler for their type. ``request_timeout`` bounds asking for a ticket and dialing.
    """

    def __init__(
        self,
        links: LaneLinks,
        registry: MessageRegistry,
        limits: Limits,
        *,
        host: str | None,
        port: int = 0,
        deliver: Callable[[BulkSender, Frame], Awaitable[None]],
        request_timeout: float,
    ) -> None:
        self.links = links
        self.request_timeout = request_timeout
        self.registry = registry
        self.limits = limits
        self.host = host  # None: client mode, no listener
        self._listen_port = port
        self.deliver = deliver
        self.accepted: set[str] = set()
        self.inline: dict[str, Callable[[str, Frame], None]] = {}
        self.loop = asyncio.get_running_loop()
        self.port: int | None = None
        self._listener: socket.socket | None = None
        self._accept_task: asyncio.Task[None] | None = None
        self._lanes: dict[str, SocketLane] = {}
        self._all: set[SocketLane] = set()
        self._dialing: dict[str, asyncio.Future[SocketLane | None]] = {}
        self._refused_at: dict[str, float] = {}
        self.tickets = TicketBook()
        self._tasks: set[asyncio.Task[object]] = set()
        self._opening: set[asyncio.Task[object]] = set()  # admissions and dials: close() cancels
        self._admitting: dict[str, int] = {}  # source → connections waiting for a ticket
        self._admissions_warned: set[str] = set()
        self.closing = False
        self.buffers = BufferPool()  # payloads received on lanes
        # peer id → loop time at which bytes last came from it on a lane, and at which a
        # lane's socket last took bytes for it: progress of frames still under way (a
        # frame on a slow link may take longer than a round's silence timeouts)
        self.heard: dict[str, float] = {}
        self.taken: dict[str, float] = {}
        register(registry)

    def last_heard(self, peer_id: str) -> float:
        """Loop time bytes last arrived from ``peer_id`` on a lane (0.0: never)."""
        return self.heard.get(peer_id, 0.0)

    def last_taken(self, peer_id: str) -> float:
        """Loop time the lane to ``peer_id`` last took bytes to send (0.0: never)."""
        return self.taken.get(peer_id, 0.0)

    def accept(self, message_type: str, inline: Callable[[str, Frame], None] | None = None) -> None:
        """Accept one-way frames of ``message_type`` on lanes (the type must be registered
        on the node with a handler). With ``inline``, a lane calls ``inline(peer_id, frame)``
        from its reader instead of the node's async handler: it must not block, and what it
        raises is logged (the frame is dropped, the lane goes on)."""
        self.accepted.add(message_type)
        if inline is not None:
            self.inline[message_type] = inline

    def has_lane(self, peer_id: str) -> bool:
        """Whether an open lane with ``peer_id`` exists (dialed by either side)."""
        lane = self._lanes.get(peer_id)
        return lane is not None and not lane.closed

    @property
    def open_lanes(self) -> int:
        """How many lanes are open, with any peer (two with one peer if both dialed at once)."""
        return sum(not lane.closed for lane in self._all)

    # ----------------------------------------------------------------- listening

    async def start(self) -> None:
        if self.host is None:
            return
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((self.host, self._listen_port))
            sock.listen(64)
            sock.setblocking(False)
        except OSError as exc:
            sock.close()
            raise TransportError(
                f"cannot listen for bulk lanes on {self.host}:{self._listen_port}: {exc}"
                " (choose another bulk_port, or 0 for any free one)"
            ) from None
        self._listener = sock
        self.port = sock.getsockname()[1]
        self._accept_task = self.loop.create_task(self._accept_loop(), name="bulk-accept")

    async def _accept_loop(self) -> None:
        assert self._listener is not None
        while True:
            try:
                conn, peer = await self.loop.sock_accept(self._listener)
            except OSError as exc:
                if self.closing:
                    return
                logger.debug("bulk accept failed: %s", exc)
                await asyncio.sleep(0.1)
                continue
            source = source_of(str(peer[0]))
            if not self._may_admit(source):
                conn.close()
                continue
            self._admitting[source] = self._admitting.get(source, 0) + 1
            task = self._spawn(self._admit(conn, source), opening=True)
            task.add_done_callback(functools.partial(self._admitted, source))

    def _may_admit(self, source: str) -> bool:
        """Whether a connection from ``source`` may wait for its preamble: at most
        :data:`MAX_ADMISSIONS` do, :data:`MAX_ADMISSIONS_PER_SOURCE` from one source, so
        connections that say nothing cannot take the node's file descriptors or lock out
        the peers that hold tickets."""
        waiting = self._admitting.get(source, 0)
        total = sum(self._admitting.values())
        if waiting < MAX_ADMISSIONS_PER_SOURCE and total < MAX_ADMISSIONS:
            return True
        if source not in self._admissions_warned:
            if len(self._admissions_warned) >= 1024:
                self._admissions_warned.clear()  # bounded, whatever the sources
            self._admissions_warned.add(source)
            logger.warning(
                "refusing bulk lane connections from %s: %d of its connections (%d in all) "
                "have not shown a ticket yet",
                source,
                waiting,
                total,
            )
        return False

    def _admitted(self, source: str, _: asyncio.Task[object]) -> None:
        left = self._admitting.get(source, 0) - 1
        if left > 0:
            self._admitting[source] = left
        else:
            self._admitting.pop(source, None)

    async def _admit(self, conn: socket.socket, source: str) -> None:
        """Read the preamble (magic, ticket, proof) and turn the connection into a lane."""
        admission = Admission(self.tickets)
        try:
            async with asyncio.timeout(ADMISSION_TIMEOUT):
                while admission.wanted():
                    data = await self.loop.sock_recv(conn, admission.wanted())
                    admission.receive(data, time.monotonic())
        except (OSError, TimeoutError) as exc:
            logger.debug("bulk lane preamble from %s failed: %s", source, exc)
        except BaseException:  # cancelled by close()
            conn.close()
            raise
        decision = admission.closed()  # the decision, or: it ended before one
        if not isinstance(decision, Admitted):
            if decision.peer_id is not None:
                logger.warning(
                    "refusing a bulk lane with the ticket of peer %s but %s: the ticket "
                    "was stolen, or the dialer is not that peer",
                    decision.peer_id,
                    decision.reason,
                )
            elif decision.reason != CLOSED:
                logger.warning("refusing a bulk lane from %s %s", source, decision.reason)
            conn.close()
            return
        if self.closing:
            conn.close()
            return
        _tune(conn)
        self._add(SocketLane(self, decision.peer_id, conn, decision.keys))

    async def on_ticket(self, link: TicketLink, frame: Frame) -> Frame:
        """Handler of ``bulk.ticket`` (a request over an authenticated link)."""
        if self.port is None or self.closing:
            raise ValueError("this peer has no bulk lanes")
        ticket = self.tickets.issue(link.peer_id, link.keys, time.monotonic())
        return TicketOffer(self.port, ticket).frame()

    # ------------------------------------------------------------------- sending

    async def send(self, peer_id: str, frame: Frame, idle_timeout: float | None = None) -> None:
        """Send a one-way frame to ``peer_id``: over a lane if possible, else the link.

        TimeoutError if a lane's socket takes no byte of the frame for ``idle_timeout``
        seconds; opening a lane, or a frame sent over the link (whose progress does not
        show), gets ``idle_timeout`` in all."""
        lane = self._lanes.get(peer_id)
        if lane is None or lane.closed:
            async with asyncio.timeout(idle_timeout):
                lane = await self._lane(peer_id)
        if lane is not None:
            try:
                await lane.send(frame, idle_timeout)
                return
            except ConnectionError as exc:
                logger.debug("%s; using the link", exc)
        async with asyncio.timeout(idle_timeout):
            await self.links.send(peer_id, frame)

    async def _lane(self, peer_id: str) -> SocketLane | None:
        lane = self._lanes.get(peer_id)
        if lane is not None and not lane.closed:
            return lane
        if self.closing:
            return None
        refused = self._refused_at.get(peer_id)
        if refused is not None and time.monotonic() - refused < _RETRY_AFTER:
            return None
        pending = self._dialing.get(peer_id)
        if pending is None:
            pending = self._dialing[peer_id] = self.loop.create_future()
            self._spawn(self._dial(peer_id, pending), opening=True)
        dialed = await asyncio.shield(pending)
        # If the peer dialed too, its lane may have become the one in use first: keep to it,
        # so that frames sent one after another are not split over two lanes (and reordered).
        lane = self._lanes.get(peer_id)
        return lane if lane is not None and not lane.closed else dialed

    async def _dial(self, peer_id: str, result: asyncio.Future[SocketLane | None]) -> None:
        lane: SocketLane | None = None
        try:
            link = await self.links.link(peer_id)
            host = _host_of(link.conn.remote_address)
            if host is None:
                raise ConnectionError("the link's remote address names no host")
            reply = await link.request(Frame(BULK_TICKET), self.request_timeout)
            offer = TicketOffer.from_frame(reply)
            keys = link.keys.lane(offer.ticket) if link.keys is not None else None
            sock = await self._connect(host, offer.port)
            try:
                async with asyncio.timeout(self.request_timeout):
                    await self.loop.sock_sendall(sock, preamble(offer.ticket, keys))
            except BaseException:  # a failure, or cancelled by close()
                sock.close()
                raise
            if self.closing:
                sock.close()
            else:
                lane = SocketLane(self, peer_id, sock, keys, dialer=True)
                self._add(lane)
        except (SwarmgradError, OSError, TimeoutError) as exc:
            self._refused_at[peer_id] = time.monotonic()
            logger.debug("no bulk lane to %s (%s): using the link", peer_id, exc)
        finally:
            self._dialing.pop(peer_id, None)
            if not result.done():
                result.set_result(lane)

    async def _connect(self, host: str, port: int) -> socket.socket:
        infos = await self.loop.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        if not infos:
            raise ConnectionError(f"cannot resolve {host}")
        family, kind, proto, _, address = infos[0]
        sock = socket.socket(family, kind, proto)
        try:
            _tune(sock)
            async with asyncio.timeout(min(_CONNECT_TIMEOUT, self.request_timeout)):
                await self.loop.sock_connect(sock, address)
        except BaseException:
            sock.close()
            raise
        return sock

    # ------------------------------------------------------------------ plumbing

    def count_sent(self, nbytes: int) -> None:
        self.links.count_sent(nbytes)

    def _add(self, lane: SocketLane) -> None:
        self._all.add(lane)
        current = self._lanes.get(lane.peer_id)
        if current is None or current.closed:
            self._lanes[lane.peer_id] = lane
        self._refused_at.pop(lane.peer_id, None)

    def forget(self, lane: SocketLane, reason: str) -> None:
        self._all.discard(lane)
        if self._lanes.get(lane.peer_id) is lane:
            del self._lanes[lane.peer_id]
            # another open lane with the same peer (both dialed at once) takes over
            for other in self._all:
                if other.peer_id == lane.peer_id and not other.closed:
                    self._lanes[lane.peer_id] = other
                    break
            else:
                self.heard.pop(lane.peer_id, None)
                self.taken.pop(lane.peer_id, None)
        logger.debug("bulk lane with %s ended: %s", lane.peer_id, reason)
        if not self.closing:
            self._spawn(lane.join())

    def _spawn(
        self, coro: Coroutine[object, object, T], *, opening: bool = False
    ) -> asyncio.Task[T]:
        task = self.loop.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        if opening:  # not lane joins: one cancelled before it ran would leave a socket open
            self._opening.add(task)
            task.add_done_callback(self._opening.discard)
        return task

    async def close(self) -> None:
        """Close the listener and every lane; wait for their tasks."""
        self.closing = True
        if self._accept_task is not None:
            self._accept_task.cancel()
        for task in self._opening:  # a silent dialer or listener must not hold shutdown up
            task.cancel()
        if self._listener is not None:
            self._listener.close()
        lanes = list(self._all)
        for lane in lanes:
            lane.close()
        for future in self._dialing.values():
            if not future.done():
                future.set_result(None)
        tasks = [t for t in self._tasks if t is not asyncio.current_task()]
        if self._accept_task is not None:
            tasks.append(self._accept_task)
        await asyncio.gather(*tasks, return_exceptions=True)
        await asyncio.gather(*(lane.join() for lane in lanes), return_exceptions=True)
        self._lanes.clear()
        self._all.clear()
        self.buffers.clear()


def _host_of(address: str) -> str | None:
    """The host to open a lane to, for a link with ``address``: none for a link through a
    relay (its frames stay on the link, through the relay) or punched through NATs (a lane
    port behind a NAT is not open to a new connection)."""
    parsed = urllib.parse.urlsplit(address)
    return None if parsed.scheme in ("relay", "punch") else parsed.hostname
