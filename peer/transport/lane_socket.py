"""One bulk lane's socket, served on the event loop: the I/O around the lane's framing.

The socket is non-blocking. Reading: a callback the loop runs whenever the socket is
readable (registered once, not per read) receives straight into the frame being read and
hands each complete frame to its handler: an *inline* one (a plain function,
:meth:`~peer.transport.bulk.BulkLanes.accept`) is called right there, with no task switch;
frames for an async handler queue up for a delivery task, and reading pauses while
:data:`_BACKLOG_FRAMES` of them wait (backpressure). Writing: :meth:`SocketLane.send` tries
the system call first and only waits for the socket to drain when it would block. No thread
hand-offs: on a 2-core machine they cost more than the copies they would overlap.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import socket
from typing import TYPE_CHECKING

from peer.exceptions import ProtocolError
from peer.transport.lane_protocol import LaneFraming
from peer.transport.lane_stream import LaneReader
from peer.transport.secure import LaneKeys, LaneOpener
from peer.wire import Frame

if TYPE_CHECKING:
    from peer.transport.bulk import BulkLanes

logger = logging.getLogger("peer.transport.bulk")  # the lanes' one log

__all__ = ["BulkSender", "SocketLane"]

_PAYLOAD_LOWAT = 512 << 10  # bytes of a payload worth waking up for (at most)
_READ_BUDGET = 8 << 20  # bytes read per wake-up of a lane before the loop's other work runs
_BACKLOG_FRAMES = 4  # frames waiting for an async handler before a lane stops reading


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


class SocketLane:
    """One TCP lane to a peer: ``send`` frames, and its reader hands out those received."""

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
        self.framing = LaneFraming(
            owner.registry, owner.limits, owner.accepted, owner.buffers.take, keys, dialer=dialer
        )
        self._stream: LaneOpener | LaneReader = self.framing.stream
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
        size, batches = self.framing.encode(frame)
        async with self._send_lock:
            if self.closed:
                raise ConnectionError(f"bulk lane to {self.peer_id} is closed")
            self.owner.count_sent(size)
            try:
                for batch in batches:
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
