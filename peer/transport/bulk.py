"""Bulk lanes: TCP side connections for large one-way frames (tensor parts).

Why: a WebSocket message costs several user-space copies on each side (framing, masking,
the stream reader's buffer, fragment joins). Averaging moves the model's size through every
peer each round, so those copies, not the network, bounded all-reduce throughput on fast
links. A bulk lane carries the *same frames* (the :mod:`peer.wire` layout: u32 header
length, msgpack header, raw payload) over a plain non-blocking TCP socket driven by the
event loop (a reader callback, and writes as the socket drains): the payload goes from the
socket straight into a buffer of the payload's size (reused: :mod:`peer.transport.buffers`), and
out of the sender's tensor memory, with no copy in user space on either side. (Threads with
blocking calls were tried first: on a 2-core machine their wake-ups cost more CPU than the
copies.) Senders and the averager's watchdog see the progress of frames under way
(:meth:`BulkLanes.last_heard`, :meth:`BulkLanes.last_taken`): a send times out when the socket takes
nothing for a while, not when a frame takes long.

Trust: a lane is only opened after an authenticated link (:mod:`peer.node.links`) exists.
The dialer asks the listener over that link for a *ticket* (16 random bytes, single use,
valid :data:`TICKET_TTL` seconds, bound to the dialer's peer id) and presents it as the
first bytes of the TCP connection; the listener then knows which authenticated peer the
lane belongs to. With encryption (the default), both ends derive the lane's keys from the
link's session and the ticket (:meth:`peer.transport.secure.SessionKeys.lane`), the dialer
follows the ticket with a proof that it holds them, and every frame travels sealed
(:class:`~peer.transport.secure.LaneSealer`): a ticket seen or stolen by someone else opens
nothing, and a record altered, replayed or injected on the way closes the lane. Frames on
a lane are validated exactly like frames on a link, and only the message types registered
as bulk (:meth:`BulkLanes.accept`) are accepted; anything else, or a malformed frame,
closes the lane (the sender falls back to its link).

Fallback: a peer without a lane listener (client mode, a transport that is not TCP, a
firewalled port) is reached over the link: :meth:`BulkLanes.send` never fails for lack of
a lane. A client-mode peer still dials lanes to others, and both directions use it.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import functools
import logging
import os
import socket
import time
import urllib.parse
from collections.abc import Callable, Coroutine
from typing import Any

from peer.exceptions import FrameTooLarge, ProtocolError, SwarmgradError, TransportError
from peer.transport.base import source_of
from peer.transport.buffers import BufferPool
from peer.transport.lane_stream import LaneReader
from peer.transport.secure import LaneKeys, LaneOpener, LaneSealer, lane_proof_ok
from peer.wire import (
    BYTES,
    INT,
    LENGTH_BYTES,
    Frame,
    Header,
    Limits,
    MessageRegistry,
    Schema,
    encode_header,
)

logger = logging.getLogger("peer.transport.bulk")

__all__ = ["BULK_TICKET", "BulkLanes", "BulkSender"]

BULK_TICKET = "bulk.ticket"
BULK_TICKET_OK = "bulk.ticket_ok"
MAGIC = b"SWGB"  # "swarmgrad bulk", version 1 of the lane preamble
TICKET_BYTES = 16
PROOF_BYTES = 32  # after the ticket on an encrypted lane: the dialer holds the lane's keys
TICKET_TTL = 30.0
_PAYLOAD_LOWAT = 512 << 10  # bytes of a payload worth waking up for (at most)
_READ_BUDGET = 8 << 20  # bytes read per wake-up of a lane before the loop's other work runs
_BACKLOG_FRAMES = 4  # frames waiting for an async handler before a lane stops reading
_RETRY_AFTER = 60.0  # seconds before trying again a lane to a peer that could not get one
_CONNECT_TIMEOUT = 3.0  # a lane port behind a firewall: fall back to the link soon
# connections to the lane port that have not shown a ticket yet (each one a file
# descriptor): in all, from one source (an IP address, an IPv6 /64), and for how long
MAX_TICKETS_PER_PEER = 8  # unused tickets one peer may hold (a lane or two takes one each)
MAX_ADMISSIONS = 128
MAX_ADMISSIONS_PER_SOURCE = 16
ADMISSION_TIMEOUT = 5.0


class BulkSender:
    """Stands in for a link when a handler receives a frame that came over a lane: it
    only names the authenticated peer (lanes are one-way: no requests, no replies)."""

    __slots__ = ("peer_id",)

    def __init__(self, peer_id: str) -> None:
        self.peer_id = peer_id


def _after(views: list[memoryview], sent: int) -> list[memoryview]:
    """What is left of ``views`` once their first ``sent`` bytes went out."""
    while views and sent >= views[0].nbytes:
        sent -= views[0].nbytes
        views = views[1:]
    if sent:
        views = [views[0][sent:], *views[1:]]
    return views


def _tune(sock: socket.socket) -> None:
    sock.setblocking(False)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    # socket buffers are left to the kernel's autotuning (a fixed size would turn it off)


class _Lane:
    """One TCP lane to a peer, served on the event loop: a reader callback, and ``send``.

    The socket is non-blocking. Reading: a callback the loop runs whenever the socket is
    readable (registered once, not per read) receives straight into the frame being read
    and hands each complete frame to its handler: an *inline* one (a plain function,
    :meth:`BulkLanes.accept`) is called right there, with no task switch; frames for an
    async handler queue up for a delivery task, and reading pauses while
    :data:`_BACKLOG_FRAMES` of them wait (backpressure). Writing: ``send`` tries the system
    call first and only waits for the socket to drain when it would block. No thread
    hand-offs: on a 2-core machine they cost more than the copies they would overlap."""

    def __init__(
        self,
        owner: BulkLanes,
        peer_id: str,
        sock: socket.socket,
        keys: LaneKeys | None = None,
        *,
        dialer: bool = False,
    ) -> None:
        self.owner = owner
        self.peer_id = peer_id
        self.sock = sock
        self.closed = False
        # encryption: one key per direction (None: a lane in clear, on a trusted network)
        self._sealer: LaneSealer | None = None
        # what parses the frames out of the bytes received (no I/O of its own)
        self._stream: LaneOpener | LaneReader
        if keys is not None:
            mine, theirs = (keys.dialer, keys.listener) if dialer else (keys.listener, keys.dialer)
            self._sealer = LaneSealer(mine)
            self._stream = LaneOpener(
                theirs, owner.registry, owner.limits, check=self._check, take=owner.buffers.take
            )
        else:
            self._stream = LaneReader(
                owner.registry, owner.limits, check=self._check, take=owner.buffers.take
            )
        self._send_lock = asyncio.Lock()
        self._lowat = 1
        self._read_now = 0  # bytes read in the current wake-up
        self._backlog: collections.deque[Frame] = collections.deque()
        self._delivery: asyncio.Task[None] | None = None
        self._reading = False
        self._ended = False
        self._resume()

    async def send(self, frame: Frame, idle_timeout: float | None = None) -> None:
        """Send one frame. Raises FrameTooLarge, before sending anything, for a frame the
        other side would refuse (it would close the lane and the frame would be lost), and
        TimeoutError (closing the lane) if the socket takes no byte of it for
        ``idle_timeout`` seconds: a slow link that keeps moving is waited for, a peer that
        stopped reading is not."""
        header = encode_header(frame)
        payload = memoryview(frame.payload).cast("B")
        limits = self.owner.limits
        if payload.nbytes > limits.max_payload_bytes:
            raise FrameTooLarge(
                f"{frame.type}: payload over the limit of {limits.max_payload_bytes} bytes"
            )
        if len(header) - LENGTH_BYTES > limits.max_header_bytes:
            raise FrameTooLarge(
                f"{frame.type}: header over the limit of {limits.max_header_bytes} bytes"
            )
        async with self._send_lock:
            if self.closed:
                raise ConnectionError(f"bulk lane to {self.peer_id} is closed")
            self.owner.core.count_sent(len(header) + payload.nbytes)
            try:
                if self._sealer is None:
                    views = (
                        [memoryview(header), payload] if payload.nbytes else [memoryview(header)]
                    )
                    await self._send_views(views, idle_timeout)
                else:
                    # sealed in batches of records into one reused buffer, each sent in turn
                    for batch in self._sealer.seal(header, payload):
                        await self._send_views(batch, idle_timeout)
            except asyncio.CancelledError:
                self.close()  # a frame abandoned midway leaves the stream unusable
                raise
            except TimeoutError:
                self.close()
                raise TimeoutError(
                    f"bulk lane to {self.peer_id} took nothing for {idle_timeout} s"
                ) from None
            except OSError as exc:
                self.close()
                raise ConnectionError(f"bulk lane to {self.peer_id} failed: {exc}") from None

    async def _send_views(self, views: list[memoryview], idle_timeout: float | None) -> None:
        # all of them in one system call (one TCP push, not a tiny header segment first);
        # whatever the socket buffer did not take goes out as it drains
        try:
            sent = self.sock.sendmsg(views)
        except (BlockingIOError, InterruptedError):
            sent = 0
        if sent:
            self.owner.taken[self.peer_id] = self.owner.loop.time()
            views = _after(views, sent)
        if views:
            await self._send_rest(views, idle_timeout)

    async def _send_rest(self, views: list[memoryview], idle_timeout: float | None) -> None:
        """Send ``views`` as the socket drains; TimeoutError once it has taken nothing for
        ``idle_timeout`` seconds."""
        loop, sock, owner = self.owner.loop, self.sock, self.owner
        writable = asyncio.Event()
        loop.add_writer(sock, writable.set)
        try:
            while views:
                writable.clear()
                try:
                    sent = sock.sendmsg(views)
                except (BlockingIOError, InterruptedError):
                    sent = 0
                if sent:
                    owner.taken[self.peer_id] = loop.time()
                    views = _after(views, sent)
                    continue
                async with asyncio.timeout(idle_timeout):
                    await writable.wait()
        finally:
            loop.remove_writer(sock)

    # ---------------------------------------------------------------- reading

    def _resume(self) -> None:
        if not self._reading and not self._ended:
            self.owner.loop.add_reader(self.sock, self._on_readable)
            self._reading = True
            if self._stream.pending:  # frames read ahead while paused: before waiting for more
                self.owner.loop.call_soon(self._on_readable)

    def _pause(self) -> None:
        if self._reading:
            self.owner.loop.remove_reader(self.sock)
            self._reading = False

    def _on_readable(self) -> None:
        """Read what the socket has (up to :data:`_READ_BUDGET` bytes: then the loop's other
        work goes first), handing out every frame completed."""
        self._read_now = 0
        stream = self._stream
        try:
            self._read(stream)
        except (BlockingIOError, InterruptedError):
            pass
        except ProtocolError as exc:
            logger.warning("closing bulk lane from %s: %s", self.peer_id, exc)
            self._end(f"protocol error: {exc}")
            return
        except (OSError, ValueError) as exc:
            self._end(str(exc) or type(exc).__name__)
            return
        if self._ended:
            return
        if self._read_now:
            self.owner.heard[self.peer_id] = self.owner.loop.time()
        # In a payload, wake up only once a good stretch of it is there (SO_RCVLOWAT):
        # fewer wake-ups and larger reads than one per arriving segment.
        lowat = min(stream.wanted(), _PAYLOAD_LOWAT) if stream.in_payload else 1
        if lowat != self._lowat:
            try:
                self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, lowat)
            except OSError:
                pass  # an old kernel: one wake-up per segment, still correct
            self._lowat = lowat

    def _read(self, stream: LaneOpener | LaneReader) -> None:
        """Bytes go from the socket into the stream's buffer (a payload's own, in clear);
        the frames they complete are handed out as they do."""
        self._take_frames(stream)
        while self._read_now < _READ_BUDGET and self._reading:
            view = stream.buffer()
            want = len(view)
            n = self.sock.recv_into(view)
            del view
            if not n:
                raise ConnectionError("lane closed by the remote")
            self._read_now += n
            stream.received(n)
            self._take_frames(stream)
            if n < want:
                break  # drained for now

    def _take_frames(self, stream: LaneOpener | LaneReader) -> None:
        """Hand out the frames received, until the handlers fall behind."""
        while self._reading:
            frame = stream.next_frame()
            if frame is None:
                return
            self._deliver(frame)
            del frame  # the handler owns the payload: nothing here may keep it alive

    def _check(self, head: Header) -> None:
        if head.type not in self.owner.accepted or head.request_id or head.reply_to:
            raise ProtocolError(f"{head.type!r} is not accepted on a bulk lane")

    def _deliver(self, frame: Frame) -> None:
        owner = self.owner
        if owner.closing:
            return
        inline = owner.inline.get(frame.type)
        if inline is not None and not self._backlog:
            try:
                inline(self.peer_id, frame)
            except Exception:  # the frame is lost, not the lane (nor the frames behind it)
                self._handler_failed(frame)
            return
        self._backlog.append(frame)
        if self._delivery is None:
            self._delivery = owner.loop.create_task(
                self._deliver_backlog(), name=f"bulk-{self.peer_id[:8]}"
            )
        if len(self._backlog) >= _BACKLOG_FRAMES:
            self._pause()  # the handler is behind: let TCP hold the sender back

    async def _deliver_backlog(self) -> None:
        owner, backlog = self.owner, self._backlog
        try:
            while backlog:
                frame = backlog.popleft()
                if len(backlog) < _BACKLOG_FRAMES:
                    self._resume()
                if owner.closing:
                    continue
                try:
                    inline = owner.inline.get(frame.type)
                    if inline is not None:
                        inline(self.peer_id, frame)
                    else:
                        await owner.deliver(BulkSender(self.peer_id), frame)
                except Exception:
                    self._handler_failed(frame)
                del frame
        finally:
            self._delivery = None

    def _handler_failed(self, frame: Frame) -> None:
        logger.exception("handling %s from bulk lane %s failed", frame.type, self.peer_id)

    def _end(self, reason: str) -> None:
        if self._ended:
            return
        self._ended = True
        self._pause()
        self.close()
        self.owner.forget(self, reason)

    def close(self) -> None:
        """Stop sending and receiving (the reader then ends the lane: :meth:`BulkLanes.forget`)."""
        if self.closed:
            return
        self.closed = True
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)

    async def join(self) -> None:
        self.close()
        self._end("closed locally")
        delivery = self._delivery
        if delivery is not None and delivery is not asyncio.current_task():
            delivery.cancel()
            await asyncio.gather(delivery, return_exceptions=True)
        self._backlog.clear()
        self.sock.close()


class BulkLanes:
    """A node's bulk lanes: a listener (unless in client mode), and lanes by peer id.

    Created by :class:`~peer.node.core.AsyncNode` when its transport runs over TCP.
    ``send(peer_id, frame)`` uses a lane when one exists or can be opened, the link
    otherwise. Frames received on lanes go to ``deliver(BulkSender, frame)``, the node's
    handler for their type.
    """

    def __init__(
        self,
        core: Any,
        registry: MessageRegistry,
        limits: Limits,
        *,
        host: str | None,
        port: int = 0,
        deliver: Callable[[BulkSender, Frame], Coroutine[Any, Any, None]],
    ) -> None:
        self.core = core
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
        self._lanes: dict[str, _Lane] = {}
        self._all: set[_Lane] = set()
        self._dialing: dict[str, asyncio.Future[_Lane | None]] = {}
        self._refused_at: dict[str, float] = {}
        # ticket → (peer id, expiry, the lane's keys when encrypting)
        self._tickets: dict[bytes, tuple[str, float, LaneKeys | None]] = {}
        self._tasks: set[asyncio.Task[Any]] = set()
        self._opening: set[asyncio.Task[Any]] = set()  # admissions and dials: close() cancels
        self._admitting: dict[str, int] = {}  # source → connections waiting for a ticket
        self._admissions_warned: set[str] = set()
        self.closing = False
        self.buffers = BufferPool()  # payloads received on lanes
        # peer id → loop time at which bytes last came from it on a lane, and at which a
        # lane's socket last took bytes for it: progress of frames still under way (a
        # frame on a slow link may take longer than a round's silence timeouts)
        self.heard: dict[str, float] = {}
        self.taken: dict[str, float] = {}
        registry.register(BULK_TICKET, Schema())
        registry.register(BULK_TICKET_OK, Schema(required={"port": INT, "ticket": BYTES}))

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

    def _admitted(self, source: str, _: asyncio.Task[Any]) -> None:
        left = self._admitting.get(source, 0) - 1
        if left > 0:
            self._admitting[source] = left
        else:
            self._admitting.pop(source, None)

    async def _admit(self, conn: socket.socket, source: str) -> None:
        """Read the preamble (magic and ticket) and turn the connection into a lane."""
        preamble = bytearray(len(MAGIC) + TICKET_BYTES)
        try:
            async with asyncio.timeout(ADMISSION_TIMEOUT):
                got = 0
                while got < len(preamble):
                    n = await self.loop.sock_recv_into(conn, memoryview(preamble)[got:])
                    if n == 0:
                        raise ConnectionError("closed during the preamble")
                    got += n
        except (OSError, TimeoutError) as exc:
            logger.debug("bulk lane preamble from %s failed: %s", source, exc)
            conn.close()
            return
        except BaseException:  # cancelled by close()
            conn.close()
            raise
        claim = self._tickets.pop(bytes(preamble[len(MAGIC) :]), None)
        if preamble[: len(MAGIC)] != MAGIC or claim is None or claim[1] < time.monotonic():
            logger.warning("refusing a bulk lane from %s without a valid ticket", source)
            conn.close()
            return
        peer_id, _, keys = claim
        if keys is not None and not await self._proven(conn, keys):
            logger.warning(
                "refusing a bulk lane with the ticket of peer %s but without proof of the "
                "link's keys: the ticket was stolen, or the dialer is not that peer",
                peer_id,
            )
            conn.close()
            return
        if self.closing:
            conn.close()
            return
        _tune(conn)
        self._add(_Lane(self, peer_id, conn, keys))

    async def _proven(self, conn: socket.socket, keys: LaneKeys) -> bool:
        """Whether the dialer follows its ticket with the proof that it holds the lane's keys."""
        proof = bytearray(PROOF_BYTES)
        got = 0
        try:
            async with asyncio.timeout(ADMISSION_TIMEOUT):
                while got < PROOF_BYTES:
                    n = await self.loop.sock_recv_into(conn, memoryview(proof)[got:])
                    if n == 0:
                        break
                    got += n
        except (OSError, TimeoutError):
            return False
        except BaseException:  # cancelled by close()
            conn.close()
            raise
        return got == PROOF_BYTES and lane_proof_ok(keys, bytes(proof))

    async def on_ticket(self, link: Any, frame: Frame) -> Frame:
        """Handler of ``bulk.ticket`` (a request over an authenticated link)."""
        if self.port is None or self.closing:
            raise ValueError("this peer has no bulk lanes")
        now = time.monotonic()
        for ticket, (_, expiry, _) in list(self._tickets.items()):
            if expiry < now:
                del self._tickets[ticket]
        if len(self._tickets) > 4096:
            raise ValueError("too many bulk tickets outstanding")
        held = sum(claim[0] == link.peer_id for claim in self._tickets.values())
        if held >= MAX_TICKETS_PER_PEER:  # nobody takes every ticket and locks others out
            raise ValueError(f"{held} bulk tickets of yours are outstanding: use them first")
        ticket = os.urandom(TICKET_BYTES)
        keys: LaneKeys | None = link.keys.lane(ticket) if link.keys is not None else None
        self._tickets[ticket] = (link.peer_id, now + TICKET_TTL, keys)
        return Frame(BULK_TICKET_OK, {"port": self.port, "ticket": ticket})

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
            await self.core.send(peer_id, frame)

    async def _lane(self, peer_id: str) -> _Lane | None:
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

    async def _dial(self, peer_id: str, result: asyncio.Future[_Lane | None]) -> None:
        lane: _Lane | None = None
        try:
            link = await self.core.link(peer_id)
            reply = await link.request(Frame(BULK_TICKET), self.core.config.request_timeout)
            host = _host_of(link.conn.remote_address)
            if host is None:
                raise ConnectionError("the link's remote address names no host")
            ticket = reply.fields["ticket"]
            keys = link.keys.lane(ticket) if link.keys is not None else None
            sock = await self._connect(host, reply.fields["port"])
            try:
                async with asyncio.timeout(self.core.config.request_timeout):
                    preamble = MAGIC + ticket + (keys.proof if keys is not None else b"")
                    await self.loop.sock_sendall(sock, preamble)
            except BaseException:  # a failure, or cancelled by close()
                sock.close()
                raise
            if self.closing:
                sock.close()
            else:
                lane = _Lane(self, peer_id, sock, keys, dialer=True)
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
            async with asyncio.timeout(min(_CONNECT_TIMEOUT, self.core.config.request_timeout)):
                await self.loop.sock_connect(sock, address)
        except BaseException:
            sock.close()
            raise
        return sock

    # ------------------------------------------------------------------ plumbing

    def _add(self, lane: _Lane) -> None:
        self._all.add(lane)
        current = self._lanes.get(lane.peer_id)
        if current is None or current.closed:
            self._lanes[lane.peer_id] = lane
        self._refused_at.pop(lane.peer_id, None)

    def forget(self, lane: _Lane, reason: str) -> None:
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

    def _spawn(self, coro: Any, *, opening: bool = False) -> asyncio.Task[Any]:
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
    parsed = urllib.parse.urlsplit(address)
    return parsed.hostname
