"""Many-peer gossip simulator: hundreds of :class:`AsyncNode` on one event loop over the
in-memory transport, in simulated time.

The loop's clock is virtual: whenever every node is waiting, time jumps to the next timer
instead of sleeping, so 500 nodes gossiping with a 1 s period take as long as the CPU work
needs, and the reported time is what the protocol would take with instant computation and
the configured link latency.
"""

from __future__ import annotations

import asyncio
import math
import selectors
import statistics
from collections.abc import Coroutine
from dataclasses import dataclass
from typing import Any

from peer.node.core import AsyncNode, NodeConfig
from peer.node.gossip import MEMBERS_KEY
from peer.transport.memory import LinkConditions, MemoryNetwork, MemoryTransport

EPOCH = 1_700_000_000.0  # simulated wall clock starts here


class _InstantSelector(selectors.DefaultSelector):
    def __init__(self) -> None:
        super().__init__()
        self.loop: VirtualTimeLoop | None = None

    def select(self, timeout: float | None = None) -> list[Any]:
        ready = super().select(0)
        if not ready and timeout and self.loop is not None:
            self.loop.virtual_time += timeout
        return ready


class VirtualTimeLoop(asyncio.SelectorEventLoop):
    """An event loop whose ``time()`` advances only when it would otherwise sleep."""

    def __init__(self) -> None:
        selector = _InstantSelector()
        super().__init__(selector)
        selector.loop = self
        self.virtual_time = 0.0

    def time(self) -> float:
        return self.virtual_time


@dataclass(frozen=True)
class SimulationResult:
    nodes: int
    converged: bool
    rounds: float  # gossip periods until every node knew every member
    simulated_seconds: float
    messages_per_node_per_round: float
    bytes_per_node_per_round: float
    median_exchanges_per_node: float


async def _simulate(
    n: int, *, fanout: int, gossip_period: float, latency: float, seed: int, max_rounds: int
) -> SimulationResult:
    loop = asyncio.get_running_loop()
    network = MemoryNetwork(latency=latency, seed=seed)
    config = NodeConfig(
        gossip_period=gossip_period, fanout=fanout, member_ttl=max_rounds * gossip_period * 4
    )

    def clock() -> float:
        return EPOCH + loop.time()

    nodes: list[AsyncNode] = []
    rng = network.random
    start = loop.time()
    for i in range(n):
        node = AsyncNode(
            [], transport=network.transport(f"h{i}"), config=config, clock=clock, seed=seed + i
        )
        await node.start(bootstrap=False)
        nodes.append(node)
    # Everyone joins at once, each bootstrapped from one random other node only.
    for i, node in enumerate(nodes[1:], start=1):
        node.gossip.initial_peers = nodes[rng.randrange(i)].visible_addresses
    await asyncio.gather(*(node.bootstrap() for node in nodes[1:]))
    messages_before, bytes_before = network.stats.messages, network.stats.bytes
    t0 = loop.time()
    converged = False
    while loop.time() - t0 < max_rounds * gossip_period:
        await asyncio.sleep(gossip_period / 4)
        now = clock()
        if all(len(node.store_.records(MEMBERS_KEY, now)) == n for node in nodes):
            converged = True
            break
    elapsed = loop.time() - start
    rounds = elapsed / gossip_period
    messages = network.stats.messages - messages_before
    sent = network.stats.bytes - bytes_before
    gossip_rounds = max((loop.time() - t0) / gossip_period, 1e-9)
    exchanges = statistics.median(node.gossip.exchanges for node in nodes)
    for node in nodes:
        await node.shutdown()
    return SimulationResult(
        nodes=n,
        converged=converged,
        rounds=rounds,
        simulated_seconds=elapsed,
        messages_per_node_per_round=messages / n / gossip_rounds,
        bytes_per_node_per_round=sent / n / gossip_rounds,
        median_exchanges_per_node=exchanges,
    )


def simulate(
    n: int,
    *,
    fanout: int = 3,
    gossip_period: float = 1.0,
    latency: float = 0.02,
    seed: int = 0,
    max_rounds: int = 60,
) -> SimulationResult:
    """Start ``n`` nodes, each bootstrapped from one random earlier node, and measure how many
    gossip rounds (and simulated seconds) pass until every node knows all ``n`` members."""
    loop = VirtualTimeLoop()
    try:
        return loop.run_until_complete(
            _simulate(
                n,
                fanout=fanout,
                gossip_period=gossip_period,
                latency=latency,
                seed=seed,
                max_rounds=max_rounds,
            )
        )
    finally:
        loop.close()


# -- building blocks of the whole-swarm simulator (bench/scale.py) -------------------------


@dataclass(frozen=True)
class AccessLink:
    """One host's access link: one-way latency (seconds) and bandwidth (bytes per second)."""

    latency: float
    bandwidth: float


class DrawnLinkNetwork(MemoryNetwork):
    """A :class:`MemoryNetwork` where every host draws its own access link when it is added
    (:meth:`add_host`): a message from ``a`` to ``b`` takes ``a``'s latency plus ``b``'s, at
    the smaller of their bandwidths. Latency and bandwidth are drawn log-uniformly from the
    given ranges, as home and datacenter links spread over orders of magnitude.

    The bandwidth holds each connection's sender back (per connection, as the transport
    models it), not the host's links together: a host talking to many peers at once gets
    more than its uplink. The simulator's groups are small, so this is noted, not modelled.
    """

    def __init__(
        self,
        *,
        seed: int,
        latency: tuple[float, float] = (0.005, 0.080),
        bandwidth: tuple[float, float] = (1e6, 100e6),
    ) -> None:
        super().__init__(seed=seed)
        if not (0 <= latency[0] <= latency[1]) or not (0 < bandwidth[0] <= bandwidth[1]):
            raise ValueError("need 0 <= latency low <= high and 0 < bandwidth low <= high")
        self.latency_range = latency
        self.bandwidth_range = bandwidth
        self.access: dict[str, AccessLink] = {}
        self._pairs: dict[tuple[str, str], LinkConditions] = {}

    def _log_uniform(self, low: float, high: float) -> float:
        if low <= 0 or low == high:
            return self.random.uniform(low, high)
        return math.exp(self.random.uniform(math.log(low), math.log(high)))

    def add_host(self, host: str) -> MemoryTransport:
        """A transport for ``host``, whose access link is drawn now."""
        self.access[host] = AccessLink(
            self._log_uniform(*self.latency_range), self._log_uniform(*self.bandwidth_range)
        )
        return self.transport(host)

    def conditions(self, src: str, dst: str) -> LinkConditions:
        found = self._pairs.get((src, dst))
        if found is not None:
            return found
        a, b = self.access.get(src), self.access.get(dst)
        if a is None or b is None:
            return super().conditions(src, dst)
        found = self._pairs[(src, dst)] = LinkConditions(
            a.latency + b.latency, min(a.bandwidth, b.bandwidth)
        )
        return found


class LoopHandle:
    """An :class:`AsyncNode` held as averaging holds a node (:class:`~peer.averaging.seam.
    NodeHandle`), for many peers on one event loop: ``run_coroutine(wait=False)`` schedules a
    task on the running loop; ``wait=True`` runs a coroutine that finishes without waiting
    (an averager's start) and refuses one that would block the loop."""

    def __init__(self, node: AsyncNode) -> None:
        self._node = node
        self._loop = asyncio.get_running_loop()

    @property
    def peer_id(self) -> str:
        return self._node.peer_id

    @property
    def client_mode(self) -> bool:
        return self._node.config.client_mode

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        return self._loop

    @property
    def core(self) -> AsyncNode:
        return self._node

    def get_time(self) -> float:
        return self._node.now()

    def run_coroutine(self, coro: Coroutine[Any, Any, Any], *, wait: bool = True) -> Any:
        if not wait:
            return self._loop.create_task(coro)
        try:
            coro.send(None)
        except StopIteration as done:
            return done.value
        coro.close()
        raise RuntimeError("LoopHandle cannot wait for a coroutine that suspends")
