"""The in-memory transport and its fault injection, in simulated time."""

from __future__ import annotations

import asyncio
import gc
from dataclasses import replace

import pytest

from peer.exceptions import ConnectionClosed, TransportError
from peer.node.core import AsyncNode, NodeConfig
from peer.node.pool import IDLE_CLOSE
from peer.transport.memory import MemoryNetwork
from peer.wire import STR, Frame, Schema
from swarmlab.node_process import wait_until_async
from swarmlab.sim import EPOCH, VirtualTimeLoop, simulate


@pytest.fixture
def vloop():
    loop = VirtualTimeLoop()
    yield loop
    loop.close()


async def _echo_pair(net: MemoryNetwork):
    received: list[bytes] = []
    done = asyncio.Event()

    async def handler(conn):
        try:
            while True:
                received.append(await conn.recv())
        except ConnectionClosed as exc:
            received.append(b"clean" if exc.clean else b"lost")
            done.set()

    listener = await net.transport("server").listen("", 0, handler)
    conn = await net.transport("client").connect(listener.addresses[0], timeout=1)
    return conn, received, done, listener


async def _chain(net: MemoryNetwork, n: int, config: NodeConfig) -> list[AsyncNode]:
    """``n`` started nodes on ``net`` (hosts ``n0``...), each bootstrapped from the one
    before it, on the running (virtual-time) loop's clock."""
    loop = asyncio.get_running_loop()
    nodes: list[AsyncNode] = []
    for i in range(n):
        node = AsyncNode(
            nodes[i - 1].visible_addresses if i else [],
            transport=net.transport(f"n{i}"),
            config=config,
            clock=lambda: EPOCH + loop.time(),
            seed=i,
        )
        await node.start()
        nodes.append(node)
    return nodes


def test_latency_and_order(vloop: VirtualTimeLoop) -> None:
    async def main():
        net = MemoryNetwork(latency=0.5)
        conn, received, done, listener = await _echo_pair(net)
        t0 = asyncio.get_running_loop().time()
        for i in range(5):
            await conn.send(bytes([i]))
        await conn.close()
        await done.wait()
        await listener.close()
        return received, asyncio.get_running_loop().time() - t0

    received, elapsed = vloop.run_until_complete(main())
    assert received == [b"\x00", b"\x01", b"\x02", b"\x03", b"\x04", b"clean"]
    assert elapsed == pytest.approx(0.5, abs=1e-6)


def test_bandwidth_holds_the_sender_back(vloop: VirtualTimeLoop) -> None:
    async def main():
        net = MemoryNetwork(bandwidth=1000.0)
        conn, received, done, listener = await _echo_pair(net)
        t0 = asyncio.get_running_loop().time()
        await conn.send(b"x" * 500)
        await conn.send([b"y" * 250, memoryview(b"z" * 250)])
        elapsed = asyncio.get_running_loop().time() - t0
        assert await wait_until_async(lambda: len(received) == 2, 60.0, 0.001)
        await conn.close()
        await done.wait()
        await listener.close()
        return elapsed, received

    elapsed, received = vloop.run_until_complete(main())
    assert elapsed == pytest.approx(1.0, abs=1e-6)
    assert received[1] == b"y" * 250 + b"z" * 250


def test_drops_and_crash(vloop: VirtualTimeLoop) -> None:
    async def main():
        net = MemoryNetwork(drop_rate=0.5, seed=1)
        conn, received, done, listener = await _echo_pair(net)
        for i in range(200):
            await conn.send(bytes([i % 256]))
        assert await wait_until_async(lambda: len(received) + net.stats.dropped == 200, 60.0, 0.001)
        delivered = len(received)
        net.crash("server")
        await done.wait()
        with pytest.raises(ConnectionClosed):
            await conn.recv()
        with pytest.raises(TransportError):
            await net.transport("other").connect(conn.remote_address, timeout=1)
        await listener.close()
        return delivered, received[-1], net.stats.dropped

    delivered, last, dropped = vloop.run_until_complete(main())
    assert 60 < delivered < 140 and dropped == 200 - delivered
    assert last == b"lost", "a crash is not a clean close"


def test_gossip_survives_a_lossy_slow_network(vloop: VirtualTimeLoop) -> None:
    """Nodes over a network that drops 10 % of messages and adds 50 ms still converge;
    a crashed node's membership expires everywhere. Each node knows only the one before it:
    at first, the dial of n3 to n2 is all that links n0-n2 to the rest, and it fails more
    often than not (a handshake and an exchange are 8 messages)."""

    async def main():
        net = MemoryNetwork(latency=0.05, drop_rate=0.1, seed=3)
        config = NodeConfig(gossip_period=1.0, member_ttl=6.0, request_timeout=2.0)
        nodes = await _chain(net, 12, config)
        ids = {n.peer_id for n in nodes}
        for _ in range(60):
            if all(set(n.members()) == ids for n in nodes):
                break
            await asyncio.sleep(0.5)
        converged = all(set(n.members()) == ids for n in nodes)
        net.crash("n5")
        dead = nodes[5].peer_id
        for _ in range(60):
            if all(dead not in n.members() for n in nodes if n is not nodes[5]):
                break
            await asyncio.sleep(0.5)
        gone = all(dead not in n.members() for n in nodes if n is not nodes[5])
        for node in nodes:
            await node.shutdown()
        return converged, gone

    converged, gone = vloop.run_until_complete(main())
    assert converged, "the membership did not converge"
    assert gone, "the crashed node's membership did not expire everywhere"


def test_an_initial_peer_that_answers_is_never_given_up(vloop: VirtualTimeLoop) -> None:
    """A newcomer's only initial peer answers, but every handshake with it fails half-way
    (what the newcomer sends is lost): it is dialed again every round, far past
    ``bootstrap_attempts``, and the newcomer joins once the link recovers. An address where
    nothing answers is dropped after those attempts (tests/attacks/test_bootstrap.py)."""

    async def main() -> tuple[bool, int, int, bool]:
        net = MemoryNetwork(latency=0.01)
        config = NodeConfig(gossip_period=1.0, member_ttl=6.0, request_timeout=1.0)
        config = replace(config, bootstrap_attempts=2)
        net.set_link("n1", "n0", drop_rate=1.0)
        first, newcomer = await _chain(net, 2, config)
        address = first.visible_addresses[0]
        rounds, dials = newcomer.gossip.rounds, net.stats.connections
        assert await wait_until_async(lambda: newcomer.gossip.rounds >= rounds + 20, 60.0, 0.1)
        kept = address in newcomer.gossip.initial_peers
        dialed = net.stats.connections - dials
        net.set_link("n1", "n0", drop_rate=0.0)
        joined = await wait_until_async(
            lambda: first.peer_id in newcomer.members() and newcomer.peer_id in first.members(),
            10.0,
            0.1,
        )
        for node in (first, newcomer):
            await node.shutdown()
        return kept, dialed, newcomer.gossip.rounds - rounds, joined

    kept, dialed, rounds, joined = vloop.run_until_complete(main())
    assert kept, "the initial peer was dropped"
    assert dialed >= 10, f"dialed {dialed} times in {rounds} rounds"
    assert joined, "the newcomer never joined"


def test_a_swarm_split_longer_than_member_ttl_heals(vloop: VirtualTimeLoop) -> None:
    """A partition outlasts membership: each side forgets the other. Once it is restored,
    departed peers are dialed again and the swarm is one again (no initial peer would be
    retried: every node still has peers on its own side)."""

    async def main():
        loop = asyncio.get_running_loop()
        net = MemoryNetwork(latency=0.01)
        config = NodeConfig(gossip_period=1.0, member_ttl=5.0, request_timeout=1.0)
        nodes = await _chain(net, 6, config)
        ids = {n.peer_id for n in nodes}

        def sizes() -> list[int]:
            return [len(set(n.members()) & ids) for n in nodes]

        async def until(predicate, limit: float) -> bool:
            deadline = loop.time() + limit
            while not predicate() and loop.time() < deadline:  # noqa: ASYNC110 - virtual time
                await asyncio.sleep(0.5)
            return predicate()

        joined = await until(lambda: sizes() == [6] * 6, 30)
        net.cut(["n0", "n1", "n2"], ["n3", "n4", "n5"])
        split = await until(lambda: sizes() == [3] * 6, 60)
        net.restore()
        healed = await until(lambda: sizes() == [6] * 6, 60)
        for node in nodes:
            await node.shutdown()
        return joined, split, healed

    joined, split, healed = vloop.run_until_complete(main())
    assert joined and split
    assert healed, "the two halves never found each other again"


def test_a_side_of_a_split_never_forgets_its_own_members(vloop: VirtualTimeLoop) -> None:
    """Exchanges with peers across a partition hang until the request timeout, longer than
    a membership lives here: they must not hold up the gossip within each side."""

    async def main() -> list[int]:
        loop = asyncio.get_running_loop()
        net = MemoryNetwork(latency=0.01)
        config = NodeConfig(gossip_period=0.2, member_ttl=3.0, request_timeout=5.0)
        nodes = await _chain(net, 4, config)
        ids = [n.peer_id for n in nodes]
        sides = ([0, 1], [2, 3])
        deadline = loop.time() + 10
        while any(set(ids) - set(n.members()) for n in nodes) and loop.time() < deadline:  # noqa: ASYNC110 - virtual time
            await asyncio.sleep(0.1)
        net.cut(["n0", "n1"], ["n2", "n3"])
        forgot = []  # times a node did not know the other node of its side
        for _ in range(200):  # 20 s: several request timeouts and membership lifetimes
            await asyncio.sleep(0.1)
            for side in sides:
                for me, other in (side, side[::-1]):
                    if ids[other] not in nodes[me].members():
                        forgot.append(me)
        for node in nodes:
            await node.shutdown()
        return forgot

    assert vloop.run_until_complete(main()) == []


def test_five_hundred_nodes_in_one_process() -> None:
    result = simulate(500, seed=0, max_rounds=40)
    assert result.converged
    # Push-pull needs O(log N) rounds; log2(500) ≈ 9. Generous: well under N/10.
    assert result.rounds < 20
    assert result.messages_per_node_per_round < 30


def test_only_links_silent_for_a_while_are_evicted(vloop: VirtualTimeLoop) -> None:
    async def main():
        loop = asyncio.get_running_loop()
        net = MemoryNetwork(latency=0.01)
        config = NodeConfig(gossip_period=60.0, member_ttl=600.0, max_links=2, link_idle_grace=5.0)
        hub = AsyncNode(
            [], transport=net.transport("hub"), config=config, clock=lambda: EPOCH + loop.time()
        )
        await hub.start()
        spokes = []
        for i in range(4):
            spoke = AsyncNode(
                hub.visible_addresses,
                transport=net.transport(f"s{i}"),
                config=config,
                clock=lambda: EPOCH + loop.time(),
                seed=i,
            )
            await spoke.start()
            spokes.append(spoke)
        busy_now = len(hub.pool.all)  # all four just exchanged: none may be closed yet
        await asyncio.sleep(6.0)
        # Use one link afresh (a gossip exchange over it); then a new link triggers eviction.
        await hub.gossip.exchange(await hub.link(spokes[0].peer_id))
        extra = AsyncNode(
            hub.visible_addresses,
            transport=net.transport("late"),
            config=config,
            clock=lambda: EPOCH + loop.time(),
            seed=9,
        )
        await extra.start()
        await asyncio.sleep(0.1)
        remaining = {lk.peer_id for lk in hub.pool.all}
        for node in (*spokes, extra, hub):
            await node.shutdown()
        return busy_now, remaining, spokes[0].peer_id, extra.peer_id

    busy_now, remaining, recent, late = vloop.run_until_complete(main())
    assert busy_now == 4, "recently used links stay open beyond max_links"
    assert remaining == {recent, late}, "the silent ones went, least recently used first"


@pytest.mark.parametrize("reason", [IDLE_CLOSE, "shutting down"])
def test_a_request_crossing_an_idle_close_goes_again_over_a_new_link(
    vloop: VirtualTimeLoop, reason: str
) -> None:
    # seen at 100 peers: a join request went out over a link its leader was just closing
    # as idle (it had more than max_links open); it failed, and the peer found no group
    async def main() -> tuple[list[str], str]:
        net = MemoryNetwork(latency=0.05)
        server, client = await _chain(net, 2, NodeConfig())
        served: list[str] = []

        async def echo(link, frame: Frame) -> Frame:
            served.append(frame.fields["x"])
            return Frame("test.echo_ok", {"x": frame.fields["x"]})

        server.register_handler("test.echo", Schema(required={"x": STR}), echo)
        client.registry.register("test.echo_ok", Schema(required={"x": STR}))
        old = await server.link(client.peer_id)
        request = asyncio.ensure_future(
            client.request(server.peer_id, Frame("test.echo", {"x": "hi"}), timeout=5.0)
        )
        await asyncio.sleep(0.01)  # the request is on its way when the server closes
        await old.close(reason)
        try:
            reply = await request
        except ConnectionClosed as exc:
            outcome = f"closed: {exc}"
        else:
            outcome = reply.fields["x"]
        for node in (client, server):
            await node.shutdown()
        return served, outcome

    served, outcome = vloop.run_until_complete(main())
    if reason == IDLE_CLOSE:
        assert (served, outcome) == (["hi"], "hi")  # once, over the new link
    else:  # any other close may have come after the request was read: not sent again
        assert served == [] and outcome.startswith("closed:")


def test_a_link_closed_as_idle_still_delivers_what_was_crossing_it(vloop: VirtualTimeLoop) -> None:
    # a node with more than max_links closes its least recently used idle link; a one-way
    # message (a tensor part) the other side sent just before must still be handled
    async def main() -> list[str]:
        net = MemoryNetwork(latency=0.05)
        config = NodeConfig(max_links=2, link_idle_grace=0.0, gossip_period=5.0)
        server, sender, _ = nodes = await _chain(net, 3, config)
        await wait_until_async(lambda: len(server.pool.all) == 2, timeout=5.0)
        heard: list[str] = []

        async def note(link, frame: Frame) -> None:
            heard.append(frame.fields["x"])

        server.register_handler("test.note", Schema(required={"x": STR}), note)
        old = sender.pool.by_peer[server.peer_id]
        await sender.send(server.peer_id, Frame("test.note", {"x": "one"}))  # in flight
        server.config = replace(config, max_links=1)
        server.pool.evict_idle()  # the sender's link, the least recently used
        await wait_until_async(lambda: old.closed, timeout=5.0)
        await sender.send(server.peer_id, Frame("test.note", {"x": "two"}))  # a new link
        await wait_until_async(lambda: len(heard) == 2, timeout=5.0)
        for node in nodes:
            await node.shutdown()
        return heard

    assert vloop.run_until_complete(main()) == ["one", "two"]


def test_a_request_whose_link_is_lost_while_it_is_sent_leaves_no_error_unread(
    vloop: VirtualTimeLoop,
) -> None:
    # the link's loss fails the request's reply future and, a moment later, its send: the
    # caller gets the send's error, and asyncio reports no failed future left unread
    async def main() -> list[str]:
        net = MemoryNetwork()
        a, b = await _chain(net, 2, NodeConfig(gossip_period=5.0))

        async def answer(link, frame: Frame) -> Frame:
            return Frame("test.ask", {"x": "ok"})

        a.register_handler("test.ask", Schema(required={"x": STR}), answer)
        unread: list[str] = []
        asyncio.get_running_loop().set_exception_handler(
            lambda _loop, context: unread.append(context["message"])
        )
        net.set_link("n1", "n0", bandwidth=1000.0)  # the request takes 10 s to send
        ask = asyncio.ensure_future(
            b.request(a.peer_id, Frame("test.ask", {"x": "x" * 10_000}), timeout=60.0)
        )

        def sending() -> bool:
            link = b.pool.by_peer.get(a.peer_id)
            return link is not None and link.busy

        assert await wait_until_async(sending, timeout=5.0)
        net.crash("n0")
        with pytest.raises(ConnectionClosed):
            await ask
        del ask
        gc.collect()  # a future is reported unread when it is collected
        await b.shutdown()
        return unread

    assert vloop.run_until_complete(main()) == []
