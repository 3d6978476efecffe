"""Rumour exchanges between real nodes over the in-memory transport, in virtual time: news
travels both ways, and what a peer offers is bounded and checked."""

from __future__ import annotations

import asyncio

import pytest

from peer.exceptions import ProtocolError
from peer.formats.identity import Identity
from peer.node.core import AsyncNode, NodeConfig
from peer.node.exchange import GOSSIP_FETCH, GOSSIP_NEWS, GOSSIP_REPLY, want_budget
from peer.node.gossip import RECORD_ID_BYTES, Record
from peer.transport.memory import MemoryNetwork
from peer.wire import Frame
from swarmlab.sim import EPOCH, VirtualTimeLoop

# no rounds of their own; one push or want reply carries at most 100 records
QUIET = NodeConfig(gossip_period=60.0, member_ttl=600.0, max_exchange_bytes=128 * 100)


@pytest.fixture
def vloop():
    loop = VirtualTimeLoop()
    yield loop
    loop.close()


async def _pair(net: MemoryNetwork) -> tuple[AsyncNode, AsyncNode]:
    loop = asyncio.get_running_loop()
    a, b = (
        AsyncNode(
            [],
            transport=net.transport(name),
            config=QUIET,
            clock=lambda: EPOCH + loop.time(),
            seed=i,
        )
        for i, name in enumerate("ab")
    )
    await a.start()
    await b.start()
    return a, b


def test_a_rumour_exchange_carries_news_both_ways_and_not_old_records(vloop) -> None:
    async def main():
        net = MemoryNetwork(latency=0.01)
        a, b = await _pair(net)
        link = await a.link(b.peer_id, b.visible_addresses)
        await a.gossip.exchange_news(link)  # membership records: news on both sides
        assert set(a.members()) == set(b.members()) == {a.peer_id, b.peer_id}
        await asyncio.sleep(60.0)  # now old news everywhere
        now = a.now()
        await a.store("from_a", 1, now + 300)
        await b.store("from_b", 2, now + 300)
        await asyncio.sleep(0.1)  # the stores' own pushes ...
        sent = net.stats.bytes
        a.store_._records.pop(b.store_.records("from_b", now)[0].rid)  # ... one was lost
        a.store_._learnt.pop(b.store_.records("from_b", now)[0].rid)
        await a.gossip.exchange_news(link)
        got = (a.store_.get("from_b", a.now()), b.store_.get("from_a", b.now()))
        cost = net.stats.bytes - sent
        for node in (a, b):
            await node.shutdown()
        return got, cost

    (from_b, from_a), cost = vloop.run_until_complete(main())
    assert from_b is not None and from_b.value == 2, "fetched from the offer"
    assert from_a is not None and from_a.value == 1
    # two records and their digests: far less than re-sending the membership records too
    assert cost < 2_000


def test_a_peer_cannot_make_a_node_fetch_more_than_one_want_reply(vloop) -> None:
    async def main():
        net = MemoryNetwork(latency=0.01)
        honest, mallory = await _pair(net)
        fetched: list[int] = []

        async def on_news(link, frame):
            # offer many ids nobody has (20-byte entries: id, sequence number), as many as
            # the field may carry
            offer = b"".join(i.to_bytes(RECORD_ID_BYTES, "big") + b"\0" * 8 for i in range(3000))
            return Frame(GOSSIP_REPLY, {"records": [], "want": b"", "offer": offer})

        async def on_fetch(link, frame):
            fetched.append(len(frame.fields["want"]) // RECORD_ID_BYTES)
            return Frame(GOSSIP_REPLY, {"records": [], "want": b""})

        mallory.handlers[GOSSIP_NEWS] = on_news
        mallory.handlers[GOSSIP_FETCH] = on_fetch
        link = await honest.link(mallory.peer_id, mallory.visible_addresses)
        await honest.gossip.exchange_news(link)

        async def torn(link, frame):
            return Frame(GOSSIP_REPLY, {"records": [], "want": b"", "offer": b"\0" * 21})

        mallory.handlers[GOSSIP_NEWS] = torn
        with pytest.raises(ProtocolError, match="multiple of 20"):
            await honest.gossip.exchange_news(link)
        for node in (honest, mallory):
            await node.shutdown()
        return fetched

    fetched = vloop.run_until_complete(main())
    assert fetched == [want_budget(QUIET.limits, QUIET.max_exchange_bytes)] == [100]


def test_more_news_than_one_reply_may_offer_is_offered_over_several_rounds(vloop) -> None:
    async def main():
        net = MemoryNetwork(latency=0.01)
        a, b = await _pair(net)
        now = b.now()
        for owner in (Identity() for _ in range(5)):
            for i in range(1000):  # 5,000 records of news at b: more than one offer carries
                b.store_.put(Record.create(owner, "k", i, i, now + 300, seq=i + 1), now)
        link = await a.link(b.peer_id, b.visible_addresses)
        counts = []
        for _ in range(3):
            await a.gossip.exchange_news(link)
            counts.append(len(a.store_))
        closed = link.closed
        for node in (a, b):
            await node.shutdown()
        return counts, closed

    counts, closed = vloop.run_until_complete(main())
    assert not closed
    # each round fetches what one reply carries (12,800 bytes here: about 97 records) of
    # what b offered; an offer of all 5,000 would be over the field's limit: a refused reply
    gained = [after - before for before, after in zip([2, *counts], counts, strict=False)]
    assert all(90 <= g <= 100 for g in gained), gained
