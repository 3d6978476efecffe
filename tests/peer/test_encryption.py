"""Encrypted links (peer.transport.secure, the handshake of peer.node.links) against a man
in the middle: a relay that forwards a handshake, then reads, alters, replays or injects."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable

import msgpack
import pytest

from peer.exceptions import ConnectionClosed, TamperedFrame, TransportError
from peer.formats.identity import Identity
from peer.node.core import AsyncNode, NodeConfig
from peer.node.exchange import GOSSIP_PUSH
from peer.node.gossip import Record
from peer.node.trust import LINK_REVOCATIONS
from peer.transport.base import Connection
from peer.transport.memory import MemoryNetwork
from peer.transport.secure import KeyExchange, LinkCipher, derive_session
from peer.wire import Frame, Limits, encode_frame
from tests.conftest import scaled

QUIET = {"gossip_period": 60.0, "member_ttl": 180.0, "request_timeout": scaled(3)}


class Relay:
    """Mallory: accepts connections and relays each to ``target``, message by message.
    ``alter`` may rewrite what the dialer sends; :attr:`to_target` lets a test inject."""

    def __init__(self, net: MemoryNetwork, target: str) -> None:
        self.transport = net.transport("mallory")
        self.target = target
        # what is passed on of each message from the dialer (None: nothing)
        self.alter: Callable[[int, bytes], bytes | None] = lambda index, data: data
        self.seen: list[bytes] = []  # what the dialer sent, in order
        self.to_target: Connection | None = None
        self.address = ""

    async def start(self) -> None:
        listener = await self.transport.listen("mallory", 0, self._serve)
        self.address = listener.addresses[0]

    async def _serve(self, inbound: Connection) -> None:
        outbound = await self.transport.connect(self.target, timeout=scaled(3))
        self.to_target = outbound

        async def pump(src: Connection, dst: Connection, record: bool) -> None:
            with contextlib.suppress(ConnectionClosed):
                while True:
                    data = await src.recv()
                    passed: bytes | None = data
                    if record:
                        self.seen.append(data)
                        passed = self.alter(len(self.seen) - 1, data)
                    if passed is not None:
                        await dst.send(passed)
            with contextlib.suppress(ConnectionClosed):
                await dst.close("relay: the other side closed")

        await asyncio.gather(pump(inbound, outbound, True), pump(outbound, inbound, False))


@pytest.fixture
async def swarm() -> AsyncIterator[tuple[AsyncNode, AsyncNode, Relay, MemoryNetwork]]:
    """Alice and Bob, and Mallory relaying every connection dialed to her on to Bob."""
    net = MemoryNetwork()
    bob = AsyncNode(transport=net.transport("bob"), config=NodeConfig(**QUIET), seed=2)
    await bob.start()
    relay = Relay(net, bob.visible_addresses[0])
    await relay.start()
    # Alice was handed Mallory's address as her way into the swarm
    alice = AsyncNode(
        [relay.address], transport=net.transport("alice"), config=NodeConfig(**QUIET), seed=1
    )
    await alice.start(bootstrap=False)
    yield alice, bob, relay, net
    await alice.shutdown()
    await bob.shutdown()


async def _linked(node: AsyncNode, peer_id: str, linked: bool = True) -> None:
    async with asyncio.timeout(scaled(5)):
        while any(link.peer_id == peer_id for link in node.pool.all) != linked:  # noqa: ASYNC110
            await asyncio.sleep(0.005)


async def test_frames_injected_after_a_relayed_handshake_are_refused_and_the_relay_named(
    swarm: tuple[AsyncNode, AsyncNode, Relay, MemoryNetwork], caplog: pytest.LogCaptureFixture
) -> None:
    alice, bob, relay, _ = swarm
    # Alice bootstraps through Mallory: the handshake passes through untouched, and the
    # gossip exchange after it too, but what Alice sends cannot be read there.
    await alice.store("diary", "meet at the old mill", alice.now() + 60)
    await alice.bootstrap()
    assert alice.pool.by_peer[bob.peer_id].conn.remote_address == relay.address
    assert relay.to_target is not None
    async with asyncio.timeout(scaled(5)):
        while (await bob.get("diary")) is None:  # noqa: ASYNC110 - pushed over the relay
            await asyncio.sleep(0.005)
    assert not any(b"old mill" in data for data in relay.seen)
    # Mallory now writes as Alice: a record of her own, in a well-formed frame.
    forged = Record.create(Identity(), "mallory", None, "owned", alice.now() + 60, seq=1)
    with caplog.at_level(logging.WARNING, logger="peer.node.links"):
        await relay.to_target.send(
            encode_frame(Frame(GOSSIP_PUSH, {"records": [forged.to_wire()]}))
        )
        await _linked(bob, alice.peer_id, False)
    assert await bob.get("mallory") is None
    messages = [r.getMessage() for r in caplog.records]
    # Bob names the peer the link belonged to and the address the forgery came from.
    assert any(
        alice.peer_id in m and "mem://mallory" in m and "failed authentication" in m
        for m in messages
    ), messages


@pytest.mark.parametrize(
    ("attack", "expected"),
    [
        ("tamper", "failed authentication"),
        ("replay", "replayed or reordered"),
        ("reorder", "replayed or reordered"),
    ],
)
async def test_a_tampered_replayed_or_reordered_frame_closes_the_link(
    swarm: tuple[AsyncNode, AsyncNode, Relay, MemoryNetwork],
    caplog: pytest.LogCaptureFixture,
    attack: str,
    expected: str,
) -> None:
    alice, bob, relay, _ = swarm
    held: list[bytes] = []

    def alter(index: int, data: bytes) -> bytes | None:
        if index < 3:  # hello, auth and ready: the handshake passes
            return data
        if attack == "tamper":
            return data[:-1] + bytes([data[-1] ^ 1])
        if attack == "replay":
            asyncio.get_running_loop().call_soon(_resend, data)
            return data
        if not held:  # reorder: hold the first message back, send it after the second
            held.append(data)
            return None
        asyncio.get_running_loop().call_soon(_resend, held[0])
        return data

    def _resend(data: bytes) -> None:
        assert relay.to_target is not None
        asyncio.get_running_loop().create_task(relay.to_target.send(data))

    relay.alter = alter
    link = await alice.link(bob.peer_id, [relay.address])
    await _linked(bob, alice.peer_id)
    with caplog.at_level(logging.WARNING, logger="peer.node.links"):
        for _ in range(2):  # two harmless one-way frames (Bob keeps no revocation list)
            await link.send(Frame(LINK_REVOCATIONS, {"list": b""}))
        await _linked(bob, alice.peer_id, False)
    assert link.remote.peer_id == bob.peer_id
    messages = [r.getMessage() for r in caplog.records]
    assert any(alice.peer_id in m and expected in m for m in messages), messages


async def test_a_relay_cannot_substitute_its_own_key_exchange_key(
    swarm: tuple[AsyncNode, AsyncNode, Relay, MemoryNetwork],
) -> None:
    """The key-exchange keys are inside the signed hellos: replacing one (to read the link
    with a key of the relay's) breaks the signature, and the handshake is refused."""
    alice, bob, relay, _ = swarm
    mallory = KeyExchange()

    def substitute(index: int, data: bytes) -> bytes:
        if index:
            return data
        length = int.from_bytes(data[:4], "big")
        header = msgpack.unpackb(data[4 : 4 + length])
        header["f"]["kx"] = mallory.public
        packed = msgpack.packb(header, use_bin_type=True)
        return len(packed).to_bytes(4, "big") + packed

    relay.alter = substitute
    with pytest.raises(TransportError, match="signature does not verify"):
        await alice.link(bob.peer_id, [relay.address])
    assert alice.num_links == 0 and bob.num_links == 0


@pytest.mark.parametrize("bob_encrypts", [True, False])
async def test_both_ends_must_agree_on_encryption(bob_encrypts: bool) -> None:
    net = MemoryNetwork()
    alice = AsyncNode(
        transport=net.transport("alice"),
        config=NodeConfig(**QUIET, encryption=not bob_encrypts),
    )
    bob = AsyncNode(
        transport=net.transport("bob"), config=NodeConfig(**QUIET, encryption=bob_encrypts)
    )
    await alice.start()
    await bob.start()
    try:
        with pytest.raises(TransportError, match="link encryption mismatch") as info:
            await alice.link(bob.peer_id, bob.visible_addresses)
        assert "trusted networks" in str(info.value)
        assert alice.num_links == 0 and bob.num_links == 0
    finally:
        await alice.shutdown()
        await bob.shutdown()


async def test_a_trusted_network_swarm_links_in_clear() -> None:
    net = MemoryNetwork()
    config = NodeConfig(**QUIET, encryption=False)
    bob = AsyncNode(transport=net.transport("bob"), config=config)
    await bob.start()
    alice = AsyncNode(bob.visible_addresses, transport=net.transport("alice"), config=config)
    await alice.start(bootstrap=False)
    try:
        await alice.store("plain", "visible", alice.now() + 60)
        await alice.bootstrap()
        assert alice.pool.by_peer[bob.peer_id].keys is None
        async with asyncio.timeout(scaled(5)):
            while (await bob.get("plain")) is None:  # noqa: ASYNC110 - pushed after the exchange
                await asyncio.sleep(0.005)
    finally:
        await alice.shutdown()
        await bob.shutdown()


def test_session_keys_mirror_each_other_and_sealed_messages_check_their_order() -> None:
    alice, bob = Identity(), Identity()
    alice_kx, bob_kx = KeyExchange(), KeyExchange()
    hello_a, hello_b = b"hello from alice", b"hello from bob"
    a = derive_session(
        alice_kx.shared(bob_kx.public), alice.public_key, hello_a, bob.public_key, hello_b
    )
    b = derive_session(
        bob_kx.shared(alice_kx.public), bob.public_key, hello_b, alice.public_key, hello_a
    )
    assert (a.send, a.recv, a.lanes) == (b.recv, b.send, b.lanes) and a.send != a.recv
    assert a.lane(b"t" * 16) == b.lane(b"t" * 16) != a.lane(b"u" * 16)
    sender, receiver = LinkCipher(a, "mem://alice"), LinkCipher(b, "mem://bob")
    first, second = sender.seal(b"one"), sender.seal([b"tw", b"o"])
    assert receiver.open(first) == b"one" and receiver.open(second) == b"two"
    for bad in (first, second, b"short", second[:-1] + bytes([second[-1] ^ 1])):
        with pytest.raises(TamperedFrame):
            receiver.open(bad)
    with pytest.raises(ValueError):  # a key of small order
        alice_kx.shared(bytes(32))


def test_sealed_lane_records_open_into_the_same_frames_however_the_stream_is_cut() -> None:
    """The lane codec without sockets: frames of every size (none, under a record, several
    records, a large header) come out whole and in order whether the bytes arrive one
    read at a time or in odd pieces; a record from another lane's key fails."""
    from peer.transport.secure import CHUNK, LaneOpener, LaneSealer
    from peer.wire import BYTES, INT, MessageRegistry, Schema, encode_header

    registry = MessageRegistry()
    registry.register("blob", Schema(optional={"seq": INT, "pad": BYTES}, payload=True))
    keys = derive_session(
        KeyExchange().shared(KeyExchange().public), b"a", b"ha", b"b", b"hb"
    ).lane(b"ticket")
    frames = [
        Frame("blob", {"seq": 0}),
        Frame("blob", {"seq": 1}, bytes(range(256)) * 3),
        Frame("blob", {"seq": 2}, bytes(2 * CHUNK + 5)),
        Frame("blob", {"seq": 3, "pad": b"x" * 9000}, b"tail"),
    ]
    sealer = LaneSealer(keys.dialer)
    stream = b"".join(
        bytes(view)
        for frame in frames
        for batch in sealer.seal(encode_header(frame), memoryview(frame.payload).cast("B"))
        for view in batch
    )

    def opened(key: bytes, pieces: list[int]) -> list[Frame]:
        opener = LaneOpener(
            key,
            registry,
            Limits(),
            check=lambda head: None,
            take=lambda n: memoryview(bytearray(n)),
        )
        out, pos, i = [], 0, 0
        while pos < len(stream):
            buffer = opener.buffer()
            n = min(len(buffer), pieces[i % len(pieces)], len(stream) - pos)
            buffer[:n] = stream[pos : pos + n]
            opener.received(n)
            pos, i = pos + n, i + 1
            while (frame := opener.next_frame()) is not None:
                out.append(frame)
        return out

    whole = stream
    # whole reads, odd pieces, and the first 12 KiB one byte at a time (two frames in it)
    for pieces, length, count in (
        ([1 << 30], len(whole), 4),
        ([7, 1, 4096, 99_999], len(whole), 4),
        ([1], 3 * 4096, 2),
    ):
        stream = whole[:length]
        got = opened(keys.dialer, pieces)
        assert [(f.fields, bytes(f.payload)) for f in got] == [
            (f.fields, bytes(f.payload)) for f in frames[:count]
        ], pieces
    stream = whole
    with pytest.raises(TamperedFrame):
        opened(keys.listener, [1 << 30])
