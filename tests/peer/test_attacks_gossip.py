"""A hostile member of the swarm, tried against real nodes: what it sends is refused, the
log names it, and the honest peers' view is unaffected."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from typing import Any

import pytest
from websockets.asyncio.client import connect as ws_connect_async
from websockets.exceptions import ConnectionClosed as WsClosed
from websockets.protocol import State as WsState
from websockets.sync.client import connect as ws_connect

from peer import Node
from peer.formats.identity import Certificate, CertificateAuth, CertificateVerifier, Identity
from peer.node.core import AsyncNode, NodeConfig
from peer.node.exchange import GOSSIP_PUSH
from peer.node.gossip import Record, pack_value
from peer.transport.memory import MemoryNetwork
from peer.wire import Frame
from swarmlab.node_process import wait_until, wait_until_async
from swarmlab.sim import EPOCH, VirtualTimeLoop
from tests.conftest import scaled


@pytest.fixture
def vloop():
    loop = VirtualTimeLoop()
    yield loop
    loop.close()


def test_a_peer_cannot_write_under_another_peers_id(
    vloop: VirtualTimeLoop, caplog: pytest.LogCaptureFixture
) -> None:
    """Mallory signs a progress record under Alice's peer id and pushes it to Carol: Carol
    refuses it, drops Mallory's link and names Mallory; Alice's own record is what Carol
    reads."""

    async def main():
        loop = asyncio.get_running_loop()
        net = MemoryNetwork(latency=0.01)
        config = NodeConfig(gossip_period=1.0, member_ttl=10.0)
        nodes: list[AsyncNode] = []
        for i, name in enumerate(["alice", "carol", "mallory"]):
            node = AsyncNode(
                nodes[0].visible_addresses if nodes else [],
                transport=net.transport(name),
                config=config,
                clock=lambda: EPOCH + loop.time(),
                seed=i,
            )
            await node.start()
            nodes.append(node)
        alice, carol, mallory = nodes
        await alice.store("run.progress", [3, 10], alice.now() + 60, subkey=alice.peer_id)

        async def carol_sees_alice() -> bool:
            found = await carol.get("run.progress")
            return found is not None and alice.peer_id in found.value

        while not await carol_sees_alice() and loop.time() < 30:  # noqa: ASYNC110 - virtual time
            await asyncio.sleep(0.2)
        assert await carol_sees_alice()
        unsigned = Record(
            "run.progress",
            alice.peer_id,
            pack_value([99, 9999]),
            mallory.now() + 60,
            mallory._next_seq(),
            mallory.identity.public_key,
            b"",
        )
        forged = dataclasses.replace(
            unsigned, signature=mallory.identity.sign(unsigned.signed_bytes())
        )
        link = await mallory.link(carol.peer_id)
        await link.send(Frame(GOSSIP_PUSH, {"records": [forged.to_wire()]}))
        await asyncio.sleep(2.0)
        seen = (await carol.get("run.progress")).value
        for node in nodes:
            await node.shutdown()
        return seen, alice.peer_id, mallory.peer_id

    with caplog.at_level(logging.WARNING, logger="peer.node"):
        seen, alice_id, mallory_id = vloop.run_until_complete(main())
    assert seen[alice_id].value == [3, 10]
    refusals = [r.getMessage() for r in caplog.records if "another peer's id" in r.getMessage()]
    assert refusals and mallory_id in refusals[0] and alice_id in refusals[0]


def test_a_flood_of_records_from_one_peer_is_capped(
    vloop: VirtualTimeLoop, caplog: pytest.LogCaptureFixture
) -> None:
    """Mallory pushes 3,000 records it signed: Carol keeps at most its quota of them, warns
    once naming Mallory, and still takes Alice's records."""

    async def main():
        loop = asyncio.get_running_loop()
        net = MemoryNetwork(latency=0.01)
        config = NodeConfig(gossip_period=1.0, member_ttl=30.0)
        nodes: list[AsyncNode] = []
        for i, name in enumerate(["alice", "carol", "mallory"]):
            node = AsyncNode(
                nodes[0].visible_addresses if nodes else [],
                transport=net.transport(name),
                config=config,
                clock=lambda: EPOCH + loop.time(),
                seed=i,
            )
            await node.start()
            nodes.append(node)
        alice, carol, mallory = nodes
        link = await mallory.link(carol.peer_id)
        flood = [
            Record.create(
                mallory.identity, f"junk{i}", None, i, mallory.now() + 60, seq=mallory._next_seq()
            ).to_wire()
            for i in range(3000)
        ]
        for start in range(0, len(flood), 500):
            await link.send(Frame(GOSSIP_PUSH, {"records": flood[start : start + 500]}))
        await asyncio.sleep(1.0)
        await alice.store("after", "still heard", alice.now() + 60)
        for _ in range(50):
            if await carol.get("after") is not None:
                break
            await asyncio.sleep(0.2)
        held = sum(
            1 for r in carol.store_._records.values() if r.owner == mallory.identity.public_key
        )
        after = await carol.get("after")
        quota = carol.store_.max_records_per_owner
        for node in nodes:
            await node.shutdown()
        return held, quota, after, mallory.peer_id

    with caplog.at_level(logging.WARNING, logger="peer.node"):
        held, quota, after, mallory_id = vloop.run_until_complete(main())
    assert held <= quota
    assert after is not None and after.value == "still heard"
    warnings = [r.getMessage() for r in caplog.records if "over its quota" in r.getMessage()]
    # each node warns once (Carol, and whoever Carol relayed the first part of it to)
    assert 1 <= len(warnings) <= 3
    assert all(w.startswith(f"peer {mallory_id} is over its quota") for w in warnings)
    assert any(
        w.endswith(f"(relayed by {mallory_id}): its further records are dropped") for w in warnings
    )


def _linked_pair() -> tuple[Node, Node]:
    a = Node(gossip_period=0.2)
    b = Node(a.visible_addresses, gossip_period=0.2)
    assert wait_until(lambda: len(a.members()) == 2 and len(b.members()) == 2, scaled(15))
    return a, b


def _gossip_still_flows(a: Node, b: Node, value: int) -> bool:
    b.store("still-there", value, b.get_time() + 60)

    def arrived() -> bool:
        found = a.get("still-there")
        return found is not None and found.value == value

    return wait_until(arrived, scaled(15))


def test_an_oversized_frame_before_authentication_is_refused(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A stranger sends 1 MiB instead of a hello: the node closes that connection without
    buffering more than the pre-authentication limit, logs its address, and carries on."""
    a, b = _linked_pair()
    try:
        with caplog.at_level(logging.INFO, logger="peer.node"):
            with ws_connect(a.visible_addresses[0], max_size=None) as ws:
                port = ws.local_address[1]
                ws.send(b"\0" * (1 << 20))
                with pytest.raises(WsClosed) as closed:
                    while True:  # the node's own hello comes first
                        ws.recv(timeout=scaled(10))
            assert closed.value.rcvd is not None and closed.value.rcvd.code == 1009
            assert wait_until(
                lambda: any(
                    f":{port}" in r.getMessage() and "1009" in r.getMessage()
                    for r in caplog.records
                ),
                scaled(5),
            )
        assert _gossip_still_flows(a, b, 1)
    finally:
        b.shutdown()
        a.shutdown()


def test_a_thousand_half_open_handshakes_do_not_take_the_node_down(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A thousand connections that never say hello: at most max_pending_handshakes (and
    max_pending_handshakes_per_source from one address) are kept, the rest are dropped
    while opening or closed at once as busy (logged with the address), and the links the
    node already has keep working."""
    a, b = _linked_pair()
    address = a.visible_addresses[0]

    async def flood() -> tuple[int, int]:
        async def one() -> Any:
            return await ws_connect_async(address, open_timeout=scaled(30))

        connections = await asyncio.gather(*(one() for _ in range(1000)), return_exceptions=True)
        opened = [c for c in connections if not isinstance(c, BaseException)]
        await asyncio.sleep(0.5)  # refused ones are closed by the node at once
        still_open = sum(c.state is WsState.OPEN for c in opened)
        busy = sum(
            c.state is not WsState.OPEN and c.close_reason is not None and "busy" in c.close_reason
            for c in opened
        )
        await asyncio.gather(*(c.close() for c in opened), return_exceptions=True)
        return still_open, busy + len(connections) - len(opened)

    try:
        with caplog.at_level(logging.WARNING, logger="peer.node"):
            still_open, busy = asyncio.run(flood())
        assert still_open <= a.core.config.max_pending_handshakes_per_source
        assert busy >= 1000 - a.core.config.max_pending_handshakes - 10
        assert any("refusing more" in r.getMessage() for r in caplog.records)
        assert _gossip_still_flows(a, b, 2)
    finally:
        b.shutdown()
        a.shutdown()


async def _certified(
    names: list[str], net: MemoryNetwork, *, lifetime: float = 3600.0, **config: Any
) -> tuple[list[AsyncNode], Identity, CertificateVerifier]:
    """Nodes of one run in certificate mode on virtual time, each bootstrapped from the
    first; also the run's authority and verifier (to certify or forge more)."""
    loop = asyncio.get_running_loop()

    def clock() -> float:
        return EPOCH + loop.time()

    authority = Identity()
    verifier = CertificateVerifier(authority.public_key, "run", clock=clock)
    nodes: list[AsyncNode] = []
    for i, name in enumerate(names):
        identity = Identity()
        certificate = Certificate.issue(
            authority, run_id="run", public_key=identity.public_key, expires_at=clock() + lifetime
        )
        node = AsyncNode(
            nodes[0].visible_addresses if nodes else [],
            transport=net.transport(name),
            identity=identity,
            auth=CertificateAuth(certificate.to_bytes(), verifier),
            config=NodeConfig(gossip_period=1.0, member_ttl=10.0, **config),
            clock=clock,
            seed=i,
        )
        await node.start()
        nodes.append(node)
    return nodes, authority, verifier


def test_records_of_a_key_without_a_certificate_are_refused_and_their_relay_named(
    vloop: VirtualTimeLoop, caplog: pytest.LogCaptureFixture
) -> None:
    """Mallory, a member of the run, pushes Carol records owned by a key the run never
    certified: first bare, then with a certificate Mallory signed herself. Carol refuses
    both, stores and relays neither, drops Mallory's link each time and names Mallory and
    the uncertified key; Alice never sees them; gossip among the members goes on."""

    async def main() -> tuple[Any, ...]:
        net = MemoryNetwork(latency=0.01)
        (alice, carol, mallory), _, _ = await _certified(["alice", "carol", "mallory"], net)
        assert await wait_until_async(
            lambda: all(len(n.members()) == 3 for n in (alice, carol, mallory)), 30.0, 0.1
        )
        sybil = Identity()
        own_made = Certificate.issue(
            mallory.identity,
            run_id="run",
            public_key=sybil.public_key,
            expires_at=mallory.now() + 3600,
        ).to_bytes()
        closed = []
        for certs in ([], [[sybil.public_key, own_made]]):
            record = Record.create(
                sybil, f"sybil{len(closed)}", None, "x", mallory.now() + 60, seq=1
            )
            link = await mallory.link(carol.peer_id)
            fields: dict[str, Any] = {"records": [record.to_wire()], "h": 2}
            if certs:
                fields["certs"] = certs
            await link.send(Frame(GOSSIP_PUSH, fields))
            closed.append(await wait_until_async(lambda link=link: link.closed, 5.0, 0.1))
        await alice.store("after", "still heard", alice.now() + 60)
        heard = await wait_until_async(
            lambda: carol.store_.get("after", carol.now()) is not None, 30.0, 0.1
        )
        await asyncio.sleep(3.0)  # gossip rounds that would carry a stored sybil record
        leaked = [
            n.peer_id
            for n in (alice, carol)
            if n.store_.records("sybil0", n.now()) or n.store_.records("sybil1", n.now())
        ]
        for node in (alice, carol, mallory):
            await node.shutdown()
        return closed, heard, leaked, mallory.peer_id, sybil.peer_id

    with caplog.at_level(logging.WARNING, logger="peer.node"):
        closed, heard, leaked, mallory_id, sybil_id = vloop.run_until_complete(main())
    assert closed == [True, True], "Carol dropped Mallory's link each time"
    assert heard and leaked == []
    refusals = [r.getMessage() for r in caplog.records if r.getMessage().startswith("rejected a")]
    assert refusals == [
        f"rejected a record relayed by {mallory_id}: its owner, peer {sybil_id}, holds no "
        "valid certificate of this run",
        f"rejected a certificate sent by {mallory_id}: the certificate sent for peer "
        f"{sybil_id} is refused: certificate is not signed by this run's authority",
    ]


def test_a_relayed_record_is_vouched_for_by_the_certificate_that_travels_with_it(
    vloop: VirtualTimeLoop,
) -> None:
    """Alice and Carol cannot reach each other; Bob links both. Carol takes Alice's
    records from Bob, checking Alice's certificate that Bob sends beside them."""

    async def main() -> tuple[Any, ...]:
        net = MemoryNetwork(latency=0.01)
        net.cut(["alice"], ["carol"])
        (bob, alice, carol), _, _ = await _certified(["bob", "alice", "carol"], net)
        await alice.store("from.alice", 42, alice.now() + 60)
        got = await wait_until_async(
            lambda: carol.store_.get("from.alice", carol.now()) is not None, 30.0, 0.1
        )
        linked = alice.peer_id in carol.pool.by_peer or carol.peer_id in alice.pool.by_peer
        vouched = alice.identity.public_key in (carol.trust.certificates or ())
        for node in (alice, bob, carol):
            await node.shutdown()
        return got, linked, vouched

    got, linked, vouched = vloop.run_until_complete(main())
    assert got and vouched
    assert not linked, "Carol learnt Alice's certificate from Bob, not from a handshake"


def test_records_of_a_peer_whose_certificate_expired_are_dropped(
    vloop: VirtualTimeLoop, caplog: pytest.LogCaptureFixture
) -> None:
    """Mallory's certificate lasts 20 s and is not renewed: once it expires, Alice drops
    her records (membership included) and takes none of them again."""

    async def main() -> tuple[Any, ...]:
        net = MemoryNetwork(latency=0.01)
        (alice, bob), authority, verifier = await _certified(["alice", "bob"], net)
        mallory_id = Identity()
        certificate = Certificate.issue(
            authority, run_id="run", public_key=mallory_id.public_key, expires_at=bob.now() + 20
        )
        mallory = AsyncNode(
            alice.visible_addresses,
            transport=net.transport("mallory"),
            identity=mallory_id,
            auth=CertificateAuth(certificate.to_bytes(), verifier),
            config=alice.config,
            clock=alice.clock,
            seed=9,
        )
        await mallory.start()
        await mallory.store("m", 1, mallory.now() + 600)
        seen = await wait_until_async(
            lambda: alice.store_.get("m", alice.now()) is not None, 30.0, 0.1
        )
        gone = await wait_until_async(
            lambda: (
                alice.store_.get("m", alice.now()) is None
                and mallory.peer_id not in alice.members()
            ),
            60.0,
            0.1,
        )
        for node in (alice, bob, mallory):
            await node.shutdown()
        return seen, gone

    with caplog.at_level(logging.INFO, logger="peer.node"):
        seen, gone = vloop.run_until_complete(main())
    assert seen and gone
    assert any("whose certificates expired" in r.getMessage() for r in caplog.records)


def test_a_relay_cannot_bring_back_an_older_copy_of_a_record(vloop: VirtualTimeLoop) -> None:
    """Alice stored a value for 10 minutes, then restarted with the same identity and
    stored a new one for 1 minute. Mallory kept the old copy (still live, longer-lived) and
    pushes it to Carol again and again: Carol keeps reading the new value."""

    async def main() -> tuple[Any, ...]:
        loop = asyncio.get_running_loop()
        net = MemoryNetwork(latency=0.01)
        config = NodeConfig(gossip_period=1.0, member_ttl=10.0)

        def node(name: str, peers: list[str], identity: Identity | None = None) -> AsyncNode:
            return AsyncNode(
                peers,
                transport=net.transport(name),
                identity=identity,
                config=config,
                clock=lambda: EPOCH + loop.time(),
                seed=len(name),
            )

        carol = node("carol", [])
        await carol.start()
        alice, mallory = (
            node("alice", carol.visible_addresses),
            node("mallory", carol.visible_addresses),
        )
        await alice.start()
        await mallory.start()
        await alice.store("state", "old", alice.now() + 600)
        assert await wait_until_async(
            lambda: mallory.store_.get("state", mallory.now()) is not None, 30.0, 0.1
        )
        kept = mallory.store_.records("state", mallory.now())[0]
        await alice.shutdown()
        await asyncio.sleep(1.0)
        restarted = node("alice2", carol.visible_addresses, alice.identity)
        await restarted.start(bootstrap=False)  # stores before it hears the old copy
        assert await restarted.store("state", "new", restarted.now() + 60)

        def carol_reads() -> Any:
            found = carol.store_.get("state", carol.now())
            return found and found.value

        assert await wait_until_async(lambda: carol_reads() == "new", 30.0, 0.1)
        link = await mallory.link(carol.peer_id)
        seen = []
        for _ in range(5):
            await link.send(Frame(GOSSIP_PUSH, {"records": [kept.to_wire()]}))
            await asyncio.sleep(1.0)  # anti-entropy rounds with Mallory run meanwhile
            seen.append(carol_reads())
        closed = link.closed
        for n in (carol, restarted, mallory):
            await n.shutdown()
        return kept, seen, closed

    kept, seen, closed = vloop.run_until_complete(main())
    assert kept.seq > 0 and seen == ["new"] * 5
    assert not closed, "an old copy is not a forgery: an honest relay may hold one"
