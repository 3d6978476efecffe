"""What gossip costs each peer in a converged swarm of N real nodes, in virtual time
(:class:`swarmlab.sim.VirtualTimeLoop`), and how fast one new record reaches everyone.

Every node runs the whole protocol (rounds, rumour exchanges, whole-store comparisons,
membership refreshes, links and their handshakes) over the in-memory transport. The swarm
starts converged: every store holds every membership record, each published a random time
ago within its refresh interval (:func:`peer.node.cost.membership_ttl`), as in a swarm
that has run for a while, so the refreshes measured come at their steady rate. Then
``window`` virtual seconds are measured, and one node stores a record and the time until
every node holds it is taken.
"""

from __future__ import annotations

import asyncio
import statistics
from dataclasses import dataclass

from peer.formats.identity import Identity
from peer.node.core import AsyncNode, NodeConfig
from peer.node.cost import membership_ttl
from peer.node.gossip import MEMBERS_KEY, Record
from peer.transport.memory import MemoryNetwork
from swarmlab.sim import EPOCH, VirtualTimeLoop

__all__ = ["GossipCost", "steady_gossip"]


@dataclass(frozen=True)
class GossipCost:
    nodes: int
    messages_per_peer_s: float
    bytes_per_peer_s: float
    store_records: float  # mean records in a peer's store
    store_bytes: float  # mean record_cost total of a peer's store
    full_share: float  # share of exchanges that compared whole stores
    spread_seconds: float | None  # a new record reached every node after this (None: not)
    gossip_period: float


async def _steady(
    n: int, *, window: float, gossip_period: float, latency: float, seed: int, spread_limit: float
) -> GossipCost:
    loop = asyncio.get_running_loop()
    network = MemoryNetwork(latency=latency, seed=seed)
    rng = network.random
    config = NodeConfig(gossip_period=gossip_period, encryption=False)  # real member_ttl

    def clock() -> float:
        return EPOCH + loop.time()

    nodes: list[AsyncNode] = []
    for i in range(n):
        node = AsyncNode(
            [],
            transport=network.transport(f"h{i}"),
            identity=Identity(),
            config=config,
            clock=clock,
            seed=seed * 100_003 + i,
        )
        await node.start(bootstrap=False)
        nodes.append(node)
    # converged: every node's membership record, published a random time ago within its
    # refresh interval, is in every store; the next refresh comes when it is due
    now = clock()
    ttl = membership_ttl(config.member_ttl, n, config.max_record_ttl)
    records: list[tuple[float, Record]] = []
    for node in nodes:
        node.gossip.swarm_size = n
        published = now - rng.uniform(0.0, ttl / 3)
        records.append(
            (
                published,
                Record.create(
                    node.identity,
                    MEMBERS_KEY,
                    node.peer_id,
                    {"addresses": node.visible_addresses, "client_mode": False},
                    published + ttl,
                    seq=node._next_seq(),
                ),
            )
        )
        node._next_refresh = published + ttl / 3
    records.sort(key=lambda pair: pair[0])
    for node in nodes:
        for published, record in records:
            node.store_.put(record, published)  # taken when it was published: old news
    await asyncio.sleep(3 * gossip_period)  # the first rounds run, links open
    before = (network.stats.messages, network.stats.bytes)
    exchanges_before = sum(node.gossip.exchanges for node in nodes)
    full_before = sum(node.gossip.full_exchanges for node in nodes)
    await asyncio.sleep(window)
    messages = (network.stats.messages - before[0]) / n / window
    sent = (network.stats.bytes - before[1]) / n / window
    exchanges = sum(node.gossip.exchanges for node in nodes) - exchanges_before
    # a full exchange counts at both ends: halve for the share of exchanges
    full = (sum(node.gossip.full_exchanges for node in nodes) - full_before) / 2
    store_records = statistics.mean(len(node.store_) for node in nodes)
    store_bytes = statistics.mean(node.store_.total_bytes for node in nodes)
    # one new record: how long until every node holds it
    source = nodes[rng.randrange(n)]
    t0 = loop.time()
    await source.store("bench.spread", 1, clock() + 600.0)
    spread: float | None = None
    while loop.time() - t0 < spread_limit:
        await asyncio.sleep(gossip_period / 20)
        now = clock()
        if all(node.store_.get("bench.spread", now) is not None for node in nodes):
            spread = loop.time() - t0
            break
    await asyncio.gather(*(node.shutdown() for node in nodes), return_exceptions=True)
    return GossipCost(
        nodes=n,
        messages_per_peer_s=messages,
        bytes_per_peer_s=sent,
        store_records=store_records,
        store_bytes=store_bytes,
        full_share=full / max(exchanges, 1),
        spread_seconds=spread,
        gossip_period=gossip_period,
    )


def steady_gossip(
    n: int,
    *,
    window: float = 30.0,
    gossip_period: float = 1.0,
    latency: float = 0.02,
    seed: int = 0,
    spread_limit: float = 60.0,
) -> GossipCost:
    """Gossip cost per peer of a converged swarm of ``n`` nodes over ``window`` virtual
    seconds, and the time one new record takes to reach all of them."""
    if n < 2 or window <= 0:
        raise ValueError("need at least 2 nodes and a positive window")
    loop = VirtualTimeLoop()
    try:
        return loop.run_until_complete(
            _steady(
                n,
                window=window,
                gossip_period=gossip_period,
                latency=latency,
                seed=seed,
                spread_limit=spread_limit,
            )
        )
    finally:
        loop.close()
