"""Bulk lanes (peer.transport.bulk) between real nodes on loopback: delivery, order, tickets,
malformed input, fallbacks and shutdown."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import socket
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import msgpack
import pytest
import torch

import peer.transport.lane_protocol as lane_protocol
import peer.transport.lane_socket as lane_socket
from peer import Node
from peer.exceptions import FrameTooLarge, NodeShutdown, RemoteError, TransportError
from peer.node.core import AsyncNode, NodeConfig
from peer.node.links import PeerLink
from peer.transport.bulk import BulkSender
from peer.transport.lane_protocol import MAGIC
from peer.transport.memory import MemoryNetwork
from peer.transport.secure import LaneSealer
from peer.transport.websocket import WebSocketTransport
from peer.wire import BYTES, INT, Frame, Limits, Schema, encode_header
from swarmlab.node_process import wait_until, wait_until_async
from tests.conftest import scaled
from tests.peer.test_node import _open_fds, _shut_down_leaving_nothing

BLOB = "test.blob"  # registered and accepted on lanes
PLAIN = "test.plain"  # registered with a handler, not accepted on lanes
BLOB_SCHEMA = Schema(optional={"seq": INT, "pad": BYTES}, payload=True)
# Gossip stays quiet during a test: the bootstrap exchange links the nodes, nothing more.
QUIET = {"gossip_period": 60.0, "member_ttl": 180.0, "request_timeout": scaled(3)}


@dataclass
class Peer:
    """A started node, with the frames its handlers received (sender, frame), in order."""

    core: AsyncNode
    received: list[tuple[Any, Frame]] = field(default_factory=list)
    _grew: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def peer_id(self) -> str:
        return self.core.peer_id

    async def handle(self, sender: Any, frame: Frame) -> None:
        self.received.append((sender, frame))
        self._grew.set()

    async def wait_for(self, count: int) -> list[tuple[Any, Frame]]:
        async with asyncio.timeout(scaled(10)):
            while len(self.received) < count:
                self._grew.clear()
                await self._grew.wait()
        return self.received[:count]


MakePeer = Callable[..., Awaitable[Peer]]


@pytest.fixture
async def make_peer() -> AsyncIterator[MakePeer]:
    peers: list[Peer] = []

    async def make(
        initial: list[str] | None = None, *, transport: Any = None, **config: Any
    ) -> Peer:
        cfg = NodeConfig(**{**QUIET, **config})
        core = AsyncNode(
            initial or [],
            transport=transport or WebSocketTransport(max_message_bytes=cfg.limits.max_frame_bytes),
            config=cfg,
        )
        peer = Peer(core)
        core.register_handler(BLOB, BLOB_SCHEMA, peer.handle)
        core.register_handler(PLAIN, Schema(), peer.handle)
        core.accept_bulk(BLOB)  # before start(), on purpose: it must still count
        await core.start()
        peers.append(peer)
        return peer

    yield make
    for peer in reversed(peers):
        await peer.core.shutdown()


async def _pair(make_peer: MakePeer, **config: Any) -> tuple[Peer, Peer]:
    """Two nodes, the second bootstrapped from the first (so a link exists both ways)."""
    a = await make_peer(**config)
    b = await make_peer(a.core.visible_addresses, **config)
    return a, b


def _lane_port(peer: Peer) -> int:
    assert peer.core.bulk is not None and peer.core.bulk.port is not None
    return peer.core.bulk.port


@contextlib.asynccontextmanager
async def _raw_lane(port: int, data: bytes) -> AsyncIterator[asyncio.StreamReader]:
    """A plain TCP connection to a lane port that sends ``data`` and nothing else."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(data)
        await writer.drain()
        yield reader
    finally:
        writer.close()
        with contextlib.suppress(OSError):
            await writer.wait_closed()


async def _closed_by_remote(reader: asyncio.StreamReader) -> bool:
    """True once the other end closes (a lane never sends anything back)."""
    async with asyncio.timeout(scaled(5)):
        try:
            return await reader.read() == b""
        except ConnectionResetError:
            return True


async def _ticket(dialer: Peer, listener: Peer) -> bytes:
    """A fresh lane ticket from ``listener``, asked for over the authenticated link."""
    reply = await dialer.core.request(listener.peer_id, Frame("bulk.ticket"))
    assert reply.fields["port"] == _lane_port(listener)
    ticket: bytes = reply.fields["ticket"]
    return ticket


async def _opening(dialer: Peer, listener: Peer) -> tuple[bytes, LaneSealer | None]:
    """What a dialer sends first on a lane (magic, ticket, and the proof of the lane's keys
    when the link is encrypted), and the sealer of what it sends next (None in clear)."""
    ticket = await _ticket(dialer, listener)
    link = await dialer.core.link(listener.peer_id)
    if link.keys is None:
        return MAGIC + ticket, None
    keys = link.keys.lane(ticket)
    return MAGIC + ticket + keys.proof, LaneSealer(keys.dialer)


def _lane_bytes(sealer: LaneSealer | None, header: bytes, payload: bytes = b"") -> bytes:
    """A frame as it travels on a lane: as is in clear, else sealed into records."""
    if sealer is None:
        return header + payload
    return b"".join(
        bytes(view) for batch in sealer.seal(header, memoryview(payload)) for view in batch
    )


def _over_lane(sender: Any, peer: Peer) -> bool:
    return isinstance(sender, BulkSender) and sender.peer_id == peer.peer_id


# --------------------------------------------------------------------------- delivery


async def test_large_frame_arrives_intact_over_a_lane_into_a_writable_buffer(
    make_peer: MakePeer,
) -> None:
    a, b = await _pair(make_peer)
    assert a.core.bulk is not None and b.core.bulk is not None
    assert not a.core.bulk.has_lane(b.peer_id)
    tensor = torch.randn(3 * 2**20 // 4 + 1)  # a few MB, sent straight from tensor memory
    await a.core.send_bulk(b.peer_id, Frame(BLOB, {"seq": 7}, memoryview(tensor.numpy())))

    [(sender, frame)] = await b.wait_for(1)
    assert _over_lane(sender, a), "the frame came over a lane, not the link"
    assert a.core.bulk.has_lane(b.peer_id) and b.core.bulk.has_lane(a.peer_id)
    assert a.core.bulk.open_lanes == b.core.bulk.open_lanes == 1
    assert frame.fields == {"seq": 7}
    payload = frame.payload
    assert isinstance(payload, memoryview) and not payload.readonly, (
        "the averager reduces into received payloads in place"
    )
    received = torch.frombuffer(payload, dtype=torch.float32)  # warns if read-only
    assert torch.equal(received, tensor)
    received.add_(1)  # really writable, and owned by the receiver
    assert torch.equal(received, tensor + 1)


async def test_received_payloads_reuse_pooled_buffers(make_peer: MakePeer) -> None:
    a, b = await _pair(make_peer)
    assert b.core.bulk is not None
    pool = b.core.bulk.buffers
    tensor = torch.randn(2**20 // 4)  # 1 MiB: one slab of the pool
    for seq in range(5):
        await a.core.send_bulk(b.peer_id, Frame(BLOB, {"seq": seq}, memoryview(tensor.numpy())))
        [(_, frame)] = await b.wait_for(1)
        assert torch.equal(torch.frombuffer(frame.payload, dtype=torch.float32), tensor)
        b.received.clear()  # the handler's reference was the last one: the slab goes back
        del frame
        assert pool.idle_bytes == 2**20
    assert pool.slabs_allocated == 1, "each payload reused the slab of the one before"


async def test_many_frames_of_varied_sizes_arrive_complete_and_in_order(
    make_peer: MakePeer,
) -> None:
    a, b = await _pair(make_peer)
    rng = random.Random(0)
    special = [0, 0, 1, 3, 5, 4095, 4096, 4097, 65_537, 2**20 + 3]
    sizes = special + [
        rng.choice([0, rng.randrange(1, 64), rng.randrange(1, 300_000)]) for _ in range(190)
    ]
    frames = []
    for seq, size in enumerate(sizes):
        fields: dict[str, Any] = {"seq": seq}
        if seq % 37 == 5:  # a header larger than the reader's look-ahead buffer
            fields["pad"] = rng.randbytes(6000 + seq)
        frames.append(Frame(BLOB, fields, rng.randbytes(size)))
    for frame in frames:  # back to back: several frames may arrive in one read
        await a.core.send_bulk(b.peer_id, frame)

    got = await b.wait_for(len(frames))
    assert [f.fields["seq"] for _, f in got] == list(range(len(frames)))
    for (sender, frame), sent in zip(got, frames, strict=True):
        assert _over_lane(sender, a)
        assert frame.fields == sent.fields
        assert bytes(frame.payload) == sent.payload
    assert a.core.bulk is not None and a.core.bulk.open_lanes == 1, "one lane carried them all"


async def _send_all(src: Peer, dst: Peer, count: int) -> list[bytes]:
    """Send ``count`` frames one after another; returns their payloads."""
    payloads = [bytes([i]) * (1000 * i + 1) for i in range(count)]
    for i, payload in enumerate(payloads):
        await src.core.send_bulk(dst.peer_id, Frame(BLOB, {"seq": i}, payload))
    return payloads


INLINE = "test.inline"  # accepted on lanes with an inline handler


async def test_inline_handler_gets_lane_frames_in_order_and_link_frames_go_to_the_handler(
    make_peer: MakePeer,
) -> None:
    a, b = await _pair(make_peer)
    inline: list[tuple[str, int]] = []
    b.core.register_handler(INLINE, BLOB_SCHEMA, b.handle)
    b.core.accept_bulk(INLINE, inline=lambda peer_id, f: inline.append((peer_id, f.fields["seq"])))
    a.core.registry.register(INLINE, BLOB_SCHEMA)
    for seq in range(50):
        await a.core.send_bulk(b.peer_id, Frame(INLINE, {"seq": seq}, bytes(seq * 997)))
    assert await wait_until_async(lambda: len(inline) == 50, scaled(10), 0.005)
    assert inline == [(a.peer_id, seq) for seq in range(50)] and not b.received
    await a.core.send(b.peer_id, Frame(INLINE, {"seq": 50}, b"link"))  # not a lane
    [(sender, frame)] = await b.wait_for(1)
    assert isinstance(sender, PeerLink) and frame.fields == {"seq": 50}


async def test_a_handler_that_raises_loses_its_frame_not_the_lane(
    make_peer: MakePeer, caplog: pytest.LogCaptureFixture
) -> None:
    a, b = await _pair(make_peer)
    seen: list[int] = []

    def handler(peer_id: str, frame: Frame) -> None:
        if frame.fields["seq"] == 1:
            raise RuntimeError("handler bug")
        seen.append(frame.fields["seq"])

    b.core.register_handler(INLINE, BLOB_SCHEMA, b.handle)
    b.core.accept_bulk(INLINE, inline=handler)
    a.core.registry.register(INLINE, BLOB_SCHEMA)
    with caplog.at_level(logging.ERROR, logger="peer.transport.bulk"):
        for seq in range(4):
            await a.core.send_bulk(b.peer_id, Frame(INLINE, {"seq": seq}, b"x" * 100_000))
        assert await wait_until_async(lambda: len(seen) == 3, scaled(10), 0.005)
    assert seen == [0, 2, 3]
    assert any("handler bug" in (r.exc_text or "") for r in caplog.records)
    assert b.core.bulk is not None and b.core.bulk.open_lanes == 1  # the same lane goes on


async def test_a_slow_async_handler_holds_the_lane_back(make_peer: MakePeer) -> None:
    """Frames for an async handler queue up to a bound; then the lane stops reading (TCP
    holds the sender back), and everything arrives in order once the handler catches up."""
    a, b = await _pair(make_peer)
    release = asyncio.Event()
    entered = asyncio.Event()

    async def slow(sender: Any, frame: Frame) -> None:
        entered.set()
        await release.wait()
        await b.handle(sender, frame)

    b.core.handlers[BLOB] = slow
    await a.core.send_bulk(b.peer_id, Frame(BLOB, {"seq": 0}, b"first"))
    await entered.wait()
    for seq in range(1, 40):
        await a.core.send_bulk(b.peer_id, Frame(BLOB, {"seq": seq}, b"y" * 1000))
    assert b.core.bulk is not None
    [lane] = b.core.bulk._all
    assert await wait_until_async(
        lambda: not lane._reading, scaled(10), 0.005
    )  # paused, with a bounded backlog
    assert len(lane._backlog) == lane_socket._BACKLOG_FRAMES
    release.set()
    received = await b.wait_for(40)
    assert [frame.fields["seq"] for _, frame in received] == list(range(40))
    assert lane._reading and not lane._backlog


async def test_both_peers_dialing_at_once_deliver_both_ways(make_peer: MakePeer) -> None:
    a, b = await _pair(make_peer)
    count = 40
    # Neither side has a lane yet: both dial at the same time.
    sent_ab, sent_ba = await asyncio.gather(_send_all(a, b, count), _send_all(b, a, count))
    for dst, src, sent in ((b, a, sent_ab), (a, b, sent_ba)):
        got = await dst.wait_for(count)
        assert all(_over_lane(sender, src) for sender, _ in got)
        assert [(f.fields["seq"], bytes(f.payload)) for _, f in got] == list(enumerate(sent))
    assert a.core.bulk is not None and b.core.bulk is not None
    assert a.core.bulk.open_lanes == b.core.bulk.open_lanes == 2, "each side dialed one"
    # Both lanes stay usable: more frames after the race still arrive, both ways.
    await a.core.send_bulk(b.peer_id, Frame(BLOB, {"seq": 1000}, b"late"))
    await b.core.send_bulk(a.peer_id, Frame(BLOB, {"seq": 1000}, b"late"))
    for dst in (a, b):
        [(_, frame)] = (await dst.wait_for(count + 1))[count:]
        assert frame.fields == {"seq": 1000} and bytes(frame.payload) == b"late"


async def test_a_sender_keeps_to_one_lane_when_the_peer_dialed_too(
    make_peer: MakePeer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """White-box: force the race where the peer's lane is admitted while our own dial is
    still connecting, and record which lane carries each of our frames."""
    a, b = await _pair(make_peer)
    lanes = a.core.bulk
    assert lanes is not None
    connect = lanes._connect

    async def connect_once_the_peer_has(host: str, port: int) -> Any:
        assert await wait_until_async(lambda: lanes.has_lane(b.peer_id), scaled(10), 0.005)
        return await connect(host, port)

    monkeypatch.setattr(lanes, "_connect", connect_once_the_peer_has)
    carriers: list[int] = []
    send = lane_socket.SocketLane.send

    async def spy(lane: Any, frame: Frame, idle_timeout: float | None = None) -> None:
        if lane.owner is lanes:
            carriers.append(id(lane))
        await send(lane, frame, idle_timeout)

    monkeypatch.setattr(lane_socket.SocketLane, "send", spy)
    await asyncio.gather(_send_all(a, b, 10), _send_all(b, a, 10))
    got = await b.wait_for(10)
    assert [f.fields["seq"] for _, f in got] == list(range(10))
    assert lanes.open_lanes == 2, "both dialed"
    assert len(carriers) == 10 and len(set(carriers)) == 1, (
        "frames sent one after another must not be split over two lanes: they could overtake"
    )


# --------------------------------------------------------------------------- tickets


async def test_connections_without_a_valid_ticket_are_refused(
    make_peer: MakePeer, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    a, b = await _pair(make_peer)
    assert b.core.bulk is not None
    port = _lane_port(b)
    valid = await _ticket(a, b)
    monkeypatch.setattr(b.core.bulk.tickets, "_ttl", -1.0)
    expired = await _ticket(a, b)
    monkeypatch.undo()
    forged = bytes(16)
    cases = {
        "wrong magic": b"HTTP" + valid,  # a valid ticket does not excuse a wrong magic
        "unknown ticket": MAGIC + forged,
        "expired ticket": MAGIC + expired,
        "used ticket": MAGIC + valid,  # consumed by the wrong-magic attempt above
    }
    for case, preamble in cases.items():
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="peer.transport.bulk"):
            async with _raw_lane(port, preamble) as reader:
                assert await _closed_by_remote(reader), case
        assert any("without a valid ticket" in r.getMessage() for r in caplog.records), case
        assert b.core.bulk.open_lanes == 0, case
    assert b.received == []


async def test_one_peer_cannot_take_every_ticket(make_peer: MakePeer) -> None:
    """A peer that asks for tickets and never uses them gets MAX_TICKETS_PER_PEER, then
    a refusal; another peer still gets one."""
    a, b = await _pair(make_peer)
    c = await make_peer(b.core.visible_addresses)
    for _ in range(lane_protocol.MAX_TICKETS_PER_PEER):
        await _ticket(a, b)
    with pytest.raises(RemoteError, match="outstanding"):
        await _ticket(a, b)
    assert len(await _ticket(c, b)) == lane_protocol.TICKET_BYTES


@pytest.mark.parametrize("encryption", [True, False])
async def test_a_ticket_is_single_use(
    make_peer: MakePeer, caplog: pytest.LogCaptureFixture, encryption: bool
) -> None:
    a, b = await _pair(make_peer, encryption=encryption)
    assert b.core.bulk is not None
    preamble, sealer = await _opening(a, b)
    first = _lane_bytes(sealer, encode_header(Frame(BLOB, {"seq": 1})))
    async with _raw_lane(_lane_port(b), preamble + first):
        # The first use opens a lane bound to the peer the ticket was issued to.
        [(sender, frame)] = await b.wait_for(1)
        assert _over_lane(sender, a) and frame.fields == {"seq": 1}
        assert b.core.bulk.has_lane(a.peer_id)
        with caplog.at_level(logging.WARNING, logger="peer.transport.bulk"):
            async with _raw_lane(_lane_port(b), preamble) as replay:
                assert await _closed_by_remote(replay)
        assert any("without a valid ticket" in r.getMessage() for r in caplog.records)
        assert b.core.bulk.open_lanes == 1
    assert await wait_until_async(
        lambda: b.core.bulk is not None and b.core.bulk.open_lanes == 0, scaled(10), 0.005
    )


async def test_a_stolen_ticket_opens_no_lane(
    make_peer: MakePeer, caplog: pytest.LogCaptureFixture
) -> None:
    """An eavesdropper who saw a ticket (or a relay that took it) holds no lane keys: the
    listener refuses it before reading any frame, whatever follows the ticket."""
    a, b = await _pair(make_peer)
    assert b.core.bulk is not None
    for attempt in ("no proof", "a guessed proof"):
        ticket = await _ticket(a, b)
        follow = b"" if attempt == "no proof" else bytes(32)
        frame = encode_header(Frame(BLOB, {"seq": 1}))
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="peer.transport.bulk"):
            async with _raw_lane(_lane_port(b), MAGIC + ticket + follow + frame) as reader:
                assert await _closed_by_remote(reader), attempt
        messages = [r.getMessage() for r in caplog.records]
        assert any("stolen" in m and a.peer_id in m for m in messages), (attempt, messages)
        assert b.core.bulk.open_lanes == 0 and b.received == []
    # the real peer still opens its lanes
    await a.core.send_bulk(b.peer_id, Frame(BLOB, {"seq": 2}, b"mine"))
    [(sender, frame)] = await b.wait_for(1)
    assert _over_lane(sender, a) and bytes(frame.payload) == b"mine"


@pytest.mark.parametrize("attack", ["tamper", "replay"])
async def test_a_tampered_or_replayed_record_closes_the_lane(
    make_peer: MakePeer, caplog: pytest.LogCaptureFixture, attack: str
) -> None:
    a, b = await _pair(make_peer)
    assert b.core.bulk is not None
    preamble, sealer = await _opening(a, b)
    assert sealer is not None
    good = _lane_bytes(sealer, encode_header(Frame(BLOB, {"seq": 0}, b"ok")), b"ok")
    if attack == "tamper":
        second = _lane_bytes(sealer, encode_header(Frame(BLOB, {"seq": 1}, b"no")), b"no")
        bad = second[:-1] + bytes([second[-1] ^ 1])  # one bit of the payload's tag
    else:
        bad = good  # the same records again
    with caplog.at_level(logging.WARNING, logger="peer.transport.bulk"):
        async with _raw_lane(_lane_port(b), preamble + good + bad) as reader:
            assert await _closed_by_remote(reader)
    messages = [r.getMessage() for r in caplog.records]
    assert any("failed authentication" in m and a.peer_id in m for m in messages), messages
    [(sender, frame)] = b.received  # the good frame, nothing after it
    assert _over_lane(sender, a) and bytes(frame.payload) == b"ok"


# --------------------------------------------------------------------------- bad frames


def _raw_header(**header: Any) -> bytes:
    packed = msgpack.packb({"v": 1, "i": 0, "r": 0, "n": 0, "f": {}, **header})
    return len(packed).to_bytes(4, "big") + packed


BAD_FRAMES = {
    "garbage": (b"\x00\x00\x00\x02\xc1\xc1", "not valid msgpack"),
    "not accepted on lanes": (encode_header(Frame(PLAIN)), "not accepted on a bulk lane"),
    "request": (encode_header(Frame(BLOB, request_id=7)), "not accepted on a bulk lane"),
    "reply": (encode_header(Frame(BLOB, reply_to=3)), "not accepted on a bulk lane"),
    "unregistered": (encode_header(Frame("test.nobody")), "unknown message type"),
    "huge header": (b"\xff\xff\xff\xff", "over the limit"),
    "huge payload": (_raw_header(t=BLOB, n=1 << 40), "over the limit"),
}


@pytest.mark.parametrize("encryption", [True, False])
@pytest.mark.parametrize("case", list(BAD_FRAMES))
async def test_a_bad_frame_closes_only_that_lane(
    make_peer: MakePeer, caplog: pytest.LogCaptureFixture, case: str, encryption: bool
) -> None:
    """Frames are checked the same in clear and sealed (where ``bad`` is what a peer with
    the lane's keys sealed)."""
    bad, reason = BAD_FRAMES[case]
    a, b = await _pair(make_peer, encryption=encryption)
    assert a.core.bulk is not None and b.core.bulk is not None
    preamble, sealer = await _opening(a, b)
    good = _lane_bytes(sealer, encode_header(Frame(BLOB, {"seq": 0}, b"ok")), b"ok")
    bad = bad if sealer is None else _lane_bytes(sealer, bad)
    with caplog.at_level(logging.WARNING, logger="peer.transport.bulk"):
        async with _raw_lane(_lane_port(b), preamble + good + bad) as reader:
            assert await _closed_by_remote(reader)
    messages = [r.getMessage() for r in caplog.records]
    assert any(reason in m and a.peer_id in m for m in messages), messages
    # The good frame before the bad one was delivered; nothing after it.
    [(sender, frame)] = b.received
    assert _over_lane(sender, a) and bytes(frame.payload) == b"ok"
    assert await wait_until_async(
        lambda: b.core.bulk is not None and b.core.bulk.open_lanes == 0, scaled(10), 0.005
    )
    # Both nodes keep working: new lanes, both ways.
    await a.core.send_bulk(b.peer_id, Frame(BLOB, {"seq": 1}, b"after"))
    await b.core.send_bulk(a.peer_id, Frame(BLOB, {"seq": 2}, b"after"))
    [(sender, frame)] = (await b.wait_for(2))[1:]
    assert _over_lane(sender, a) and frame.fields == {"seq": 1}
    [(sender, frame)] = await a.wait_for(1)
    assert _over_lane(sender, b) and frame.fields == {"seq": 2}


async def test_a_frame_over_the_limits_is_refused_before_sending(make_peer: MakePeer) -> None:
    small = Limits(max_header_bytes=4096, max_payload_bytes=1024)
    a, b = await _pair(make_peer, limits=small)
    await a.core.send_bulk(b.peer_id, Frame(BLOB, {"seq": 0}, b"x" * 1024))
    with pytest.raises(FrameTooLarge, match="payload over the limit"):
        await a.core.send_bulk(b.peer_id, Frame(BLOB, {"seq": 1}, b"x" * 1025))
    with pytest.raises(FrameTooLarge, match="header over the limit"):
        await a.core.send_bulk(b.peer_id, Frame(BLOB, {"seq": 2, "pad": b"y" * 5000}))
    # Nothing went out, so the lane is still healthy and carries the next frame.
    await a.core.send_bulk(b.peer_id, Frame(BLOB, {"seq": 3}, b"z"))
    got = await b.wait_for(2)
    assert [f.fields["seq"] for _, f in got] == [0, 3]
    assert all(_over_lane(sender, a) for sender, _ in got)
    assert a.core.bulk is not None and a.core.bulk.open_lanes == 1


# --------------------------------------------------------------------------- slow peers

SMALL_BUFFER = 64 << 10


async def _lane_between(a: Peer, b: Peer) -> tuple[Any, Any]:
    """Open the lane from ``a`` to ``b`` (one small frame) and shrink the socket buffers of
    both ends, so that a frame of a few MB waits for ``b`` to read it."""
    await a.core.send_bulk(b.peer_id, Frame(BLOB, {"seq": 0}, b"open"))
    await b.wait_for(1)
    assert a.core.bulk is not None and b.core.bulk is not None
    [sending] = a.core.bulk._all
    [receiving] = b.core.bulk._all
    sending.sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SMALL_BUFFER)
    receiving.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, SMALL_BUFFER)
    return sending, receiving


def _read_slowly(lane: Any, monkeypatch: pytest.MonkeyPatch, pause: float) -> None:
    """Make ``lane`` read at most one small chunk, then nothing for ``pause`` seconds."""
    monkeypatch.setattr(lane_socket, "_READ_BUDGET", SMALL_BUFFER)
    read = lane._on_readable

    def then_pause() -> None:
        read()
        if lane._reading:
            lane._pause()
            lane.owner.loop.call_later(pause, lane._resume)

    lane._pause()
    lane._on_readable = then_pause
    lane._resume()


async def test_a_send_to_a_slow_reader_outlasts_the_idle_timeout(
    make_peer: MakePeer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The timeout of a send is for a socket that takes nothing: a frame that takes far
    longer than it on a slow link goes through, and both ends record the progress."""
    a, b = await _pair(make_peer)
    _, receiving = await _lane_between(a, b)
    _read_slowly(receiving, monkeypatch, pause=0.05)
    assert a.core.bulk is not None and b.core.bulk is not None
    payload = bytes(random.Random(1).randbytes(2 << 20))
    idle_timeout = 0.2
    started = time.monotonic()
    await a.core.bulk.send(b.peer_id, Frame(BLOB, {"seq": 1}, payload), idle_timeout)
    [_, (sender, frame)] = await b.wait_for(2)
    elapsed = time.monotonic() - started
    assert elapsed > 2 * idle_timeout, f"the link was not slow ({elapsed:.2f} s): no test"
    assert _over_lane(sender, a) and bytes(frame.payload) == payload
    # progress of the frame while it was under way, as the averager's watchdog sees it
    now = asyncio.get_running_loop().time()
    assert b.core.bulk.heard[a.peer_id] > now - elapsed / 2
    assert a.core.bulk.taken[b.peer_id] > now - elapsed / 2


async def test_a_send_to_a_peer_that_stopped_reading_times_out_and_closes_the_lane(
    make_peer: MakePeer,
) -> None:
    a, b = await _pair(make_peer)
    sending, receiving = await _lane_between(a, b)
    receiving._pause()  # reads nothing more, its connection open
    assert a.core.bulk is not None
    with pytest.raises(TimeoutError, match=r"took nothing for 0\.2 s"):
        await a.core.bulk.send(b.peer_id, Frame(BLOB, {"seq": 1}, b"x" * (4 << 20)), 0.2)
    assert sending.closed and not a.core.bulk.has_lane(b.peer_id)


# --------------------------------------------------------------------------- fallbacks


@pytest.mark.parametrize("without_lanes", ["memory transport", "bulk_lanes=False"])
async def test_without_lanes_bulk_frames_go_over_the_link(
    make_peer: MakePeer, without_lanes: str
) -> None:
    if without_lanes == "memory transport":
        net = MemoryNetwork()
        a = await make_peer(transport=net.transport("a"))
        b = await make_peer(a.core.visible_addresses, transport=net.transport("b"))
    else:
        a, b = await _pair(make_peer, bulk_lanes=False)
    assert a.core.bulk is None and b.core.bulk is None
    await a.core.send_bulk(b.peer_id, Frame(BLOB, {"seq": 1}, b"m" * 100_003))
    [(sender, frame)] = await b.wait_for(1)
    assert isinstance(sender, PeerLink) and sender.peer_id == a.peer_id
    assert bytes(frame.payload) == b"m" * 100_003


async def test_client_mode_peer_dials_a_lane_used_both_ways(make_peer: MakePeer) -> None:
    server = await make_peer()
    client = await make_peer(server.core.visible_addresses, client_mode=True)
    assert client.core.bulk is not None and client.core.bulk.port is None
    assert server.core.bulk is not None
    # The server cannot dial a client: its first frame goes over the link.
    await server.core.send_bulk(client.peer_id, Frame(BLOB, {"seq": 0}, b"s0"))
    [(sender, frame)] = await client.wait_for(1)
    assert isinstance(sender, PeerLink) and frame.fields == {"seq": 0}
    assert not server.core.bulk.has_lane(client.peer_id)
    # The client dials one; from then on both directions use it.
    await client.core.send_bulk(server.peer_id, Frame(BLOB, {"seq": 1}, b"c1" * 50_000))
    [(sender, frame)] = await server.wait_for(1)
    assert _over_lane(sender, client) and bytes(frame.payload) == b"c1" * 50_000
    assert server.core.bulk.has_lane(client.peer_id)
    await server.core.send_bulk(client.peer_id, Frame(BLOB, {"seq": 2}, b"s2" * 50_000))
    [(sender, frame)] = (await client.wait_for(2))[1:]
    assert _over_lane(sender, server) and bytes(frame.payload) == b"s2" * 50_000
    assert client.core.bulk.open_lanes == server.core.bulk.open_lanes == 1


# --------------------------------------------------------------------------- shutdown


async def test_shutdown_does_not_wait_for_a_silent_connection(make_peer: MakePeer) -> None:
    a = await make_peer()
    async with _raw_lane(_lane_port(a), MAGIC[:2]) as reader:  # half a preamble, then silence
        assert await wait_until_async(
            lambda: a.core.bulk is not None and len(a.core.bulk._tasks) == 1, scaled(10), 0.005
        )
        started = time.monotonic()
        await a.core.shutdown()
        assert time.monotonic() - started < scaled(2.5), "shutdown waited for the preamble (5 s)"
        assert await _closed_by_remote(reader)


async def test_shutdown_does_not_wait_for_a_peer_that_never_hands_out_a_ticket(
    make_peer: MakePeer,
) -> None:
    a, b = await _pair(make_peer)
    asked = asyncio.Event()

    async def stall(link: Any, frame: Frame) -> Frame:
        asked.set()
        await asyncio.Event().wait()  # never answers (until its link closes)
        raise AssertionError("unreachable")

    b.core.handlers["bulk.ticket"] = stall
    sending = asyncio.create_task(a.core.send_bulk(b.peer_id, Frame(BLOB, {"seq": 0}, b"x")))
    async with asyncio.timeout(scaled(5)):
        await asked.wait()
    started = time.monotonic()
    await a.core.shutdown()
    assert time.monotonic() - started < scaled(2.5), "shutdown waited for the ticket"
    with pytest.raises(NodeShutdown):
        await sending


def test_shutdown_with_open_lanes_leaves_no_task_thread_or_socket() -> None:
    threads_before = set(threading.enumerate())
    sockets_before = {fd for fd in _open_fds() if fd.startswith("socket:")}
    fast = {"gossip_period": 0.2, "request_timeout": scaled(3)}
    a = Node(**fast)
    b = Node(a.visible_addresses, **fast)
    c = Node(b.visible_addresses, client_mode=True, **fast)
    nodes = (a, b, c)
    assert wait_until(lambda: len(a.members()) == 3, scaled(10))

    async def setup(node: Node) -> Peer:
        peer = Peer(node.core)
        node.core.register_handler(BLOB, BLOB_SCHEMA, peer.handle)
        node.core.accept_bulk(BLOB)
        return peer

    peers = [node.run_coroutine(setup(node)) for node in nodes]

    async def send(src: Node, dst: Node) -> None:
        await src.core.send_bulk(dst.peer_id, Frame(BLOB, {"seq": 0}, b"x" * 200_000))

    expected = [0, 0, 0]
    for src, dst in ((a, b), (b, a), (c, a), (c, b), (b, c)):
        src.run_coroutine(send(src, dst))
        expected[nodes.index(dst)] += 1  # delivered (the lane admitted) before the next one
        assert wait_until(lambda: [len(p.received) for p in peers] == expected, scaled(10))
    assert all(isinstance(s, BulkSender) for p in peers for s, _ in p.received)
    lanes = [n.core.bulk.open_lanes for n in nodes if n.core.bulk is not None]
    assert lanes == [2, 2, 2], lanes

    # a lane's other end may be shut down first or last
    _shut_down_leaving_nothing((c, b, a), threads_before, sockets_before)


async def test_a_fixed_lane_port_is_used(make_peer: MakePeer) -> None:
    with socket.socket() as probe:  # a port free right now
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    a = await make_peer(bulk_port=port)
    b = await make_peer(a.core.visible_addresses)
    assert _lane_port(a) == port
    await b.core.send_bulk(a.peer_id, Frame(BLOB, {"seq": 1}, b"p" * 1000))
    [(sender, _)] = await a.wait_for(1)
    assert _over_lane(sender, b)
    # the port is taken now: a node asked for it says so, and leaves nothing open
    with pytest.raises(TransportError, match=f"bulk lanes on 127.0.0.1:{port}"):
        await make_peer(bulk_port=port)


async def test_a_lane_port_that_does_not_answer_falls_back_to_the_link(
    make_peer: MakePeer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A firewalled lane port: the frame goes over the link, and no new lane is tried for a
    while (each try would hold the sender up to the connect timeout)."""
    a, b = await _pair(make_peer)
    with socket.socket() as dead:  # bound, not listening: connections are refused
        dead.bind(("127.0.0.1", 0))
        assert a.core.bulk is not None
        monkeypatch.setattr(a.core.bulk, "port", dead.getsockname()[1])
        await b.core.send_bulk(a.peer_id, Frame(BLOB, {"seq": 1}, b"f" * 1000))
        [(sender, frame)] = await a.wait_for(1)
        assert isinstance(sender, PeerLink) and bytes(frame.payload) == b"f" * 1000
        assert b.core.bulk is not None and not b.core.bulk.has_lane(a.peer_id)
        asked = []
        original = b.core.bulk._dial

        async def dial(*args: Any) -> None:
            asked.append(args)
            await original(*args)

        monkeypatch.setattr(b.core.bulk, "_dial", dial)
        await b.core.send_bulk(a.peer_id, Frame(BLOB, {"seq": 2}, b"g" * 10))
        await a.wait_for(2)
        assert asked == []  # within the retry delay: straight to the link
