"""A whole swarm in virtual time: how matchmaking, Moshpit averaging, gossip and state
downloads hold from 50 to 1,000 peers.

    python bench/scale.py --peers 1000         # one size: the table, in under 10 minutes
    python bench/scale.py                      # N = 50, 100, 250, 500, 1000, table + PNG
    python bench/scale.py --peers 100 --full-max 100   # the real protocol for every peer

Every peer is a real :class:`~peer.node.AsyncNode` on the in-memory transport, on the one
virtual-time loop of :mod:`swarmlab.sim` (time jumps to the next timer whenever every peer
waits, so the figures are protocol time, not this machine's). Each host draws its access
link (one-way latency 5-80 ms, bandwidth 1-100 MB/s, log-uniform; a message pays both
ends' latency, at the slower end's bandwidth); a share of the peers are in client mode
(they dial out only). Peers sit on a Moshpit grid of ``d = ⌈log_g N⌉`` dimensions whose side
is the smallest ``m ≤ g`` with ``mᵈ ≥ N``, so groups have ``m`` members; every round each
present peer calls the real :class:`~peer.averaging.DecentralizedAverager`'s ``step``
(gossip declarations, the matchmaking state machine and its driver, the butterfly round
and its runner, exclusion of the dead). Churn: before each round a share of the peers
leave (half of them crash in the middle of the round's all-reduce, the others between
rounds) and as many newcomers arrive, each bootstrapping from one peer, downloading the
state with ``load_state_from_peers`` (counted per donor) and taking a free place on the
grid.

What is sampled, and why
------------------------
Two cores cannot run the whole protocol for 1,000 peers in 10 minutes: every peer's gossip
rounds compare digests of the whole membership, so the swarm's gossip CPU grows as N², and
on top of it run N averagers. So, above ``--full-max`` peers (default 100):

* **gossip** still runs for all N real nodes (stores seeded with the converged membership,
  then measured over a steady window): messages and bytes per peer per second and the
  store size per peer are full-fidelity at every N;
* **Moshpit rounds** use the real grid functions of :mod:`peer.averaging.group_bits`
  (``group_key``, ``slot_in_group``, ``next_group_bits``) with each group's exact mean —
  what the butterfly computes, which the full tier checks to 1e-6 — and the same churn
  (a peer that dies mid-round drops out of its group's mean, as the runner excludes it);
* **matchmaking, failed rounds, newcomers and donors** come from a full-fidelity swarm of
  ``--full-max`` peers (its own grid, of side ``m ≤ g`` like every size's): a peer's
  matchmaking sees only the ``m`` peers of its key and a newcomer's download touches one
  donor, so those figures depend on ``m`` and the churn rate rather than on N; the table
  marks them ``*``.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import math
import random
import statistics
import sys
import time
from collections import Counter
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

from peer.averaging.averager import DecentralizedAverager
from peer.averaging.control import StepControl
from peer.averaging.exceptions import StepFailed
from peer.averaging.group_bits import (
    bits_per_coordinate,
    group_key,
    next_group_bits,
    slot_in_group,
)
from peer.averaging.state import StateServer
from peer.formats.identity import Identity
from peer.node.core import AsyncNode, NodeConfig
from peer.node.cost import membership_ttl
from peer.node.gossip import MEMBERS_KEY, Record
from peer.wire import Frame
from swarmlab.sim import EPOCH, DrawnLinkNetwork, LoopHandle, VirtualTimeLoop

SIZES = (50, 100, 250, 500, 1000)
PREFIX = "scale"
TOLERANCE = 1e-6


@dataclass(frozen=True)
class Settings:
    group_size: int = 16  # g: the largest group (the grid's side is at most this)
    churn: float = 0.10  # share of the peers that leave (and arrive) per round
    churn_rounds: int | None = None  # the rounds with churn (None: all); calm after them
    client_share: float = 0.10
    numel: int = 16  # averaged values per peer (the protocol, not the arithmetic)
    rounds: int = 6  # averaging rounds simulated
    round_period: float = 12.0  # virtual seconds between rounds
    min_matchmaking_time: float = 2.0
    gossip_period: float = 1.0
    gossip_window: float = 10.0  # virtual seconds of steady gossip measured
    gossip_live: int = 100  # gossip nodes run; the other members' records are refreshed
    seed: int = 0


# -- the grid ---------------------------------------------------------------------------------


def grid_shape(n: int, g: int) -> tuple[int, int]:
    """``(d, m)``: ``d = ⌈log_g n⌉`` dimensions and the smallest side ``m ≤ g`` with
    ``mᵈ ≥ n`` (integer arithmetic: no float rounding at exact powers)."""
    if n < 2 or g < 2:
        raise ValueError("need at least 2 peers and groups of at least 2")
    d = 1
    while g**d < n:
        d += 1
    m = 2
    while m**d < n:
        m += 1
    return d, m


def grid_bits_at(position: int, d: int, m: int) -> str:
    """Group bits of grid cell ``position`` (mixed radix, base ``m``): the first coordinate
    is the place in the round-0 group, so cells ``0 … m-1`` meet first."""
    w = bits_per_coordinate(m)
    coords = []
    for _ in range(d):
        coords.append(format(position % m, f"0{w}b"))
        position //= m
    return "".join(coords)


def all_cells(d: int, m: int) -> list[str]:
    return [grid_bits_at(p, d, m) for p in range(m**d)]


def newcomer_cell(
    cells: list[str], taken: set[str], donor_bits: str | None, m: int, rng: random.Random
) -> str:
    """The grid cell a newcomer takes: a free one in its donor's last group if there is one
    (the cells that share the donor's bits but the last coordinate, written by the round
    the donor last averaged in), so that it holds what the peer it replaces held; else any
    free cell; else (a full grid) any cell."""
    free = [c for c in cells if c not in taken]
    if donor_bits is not None and len(donor_bits) == len(cells[0]):
        w = bits_per_coordinate(m)
        same_group = [c for c in free if c[:-w] == donor_bits[:-w]]
        if same_group:
            return rng.choice(same_group)
    return rng.choice(free) if free else rng.choice(cells)


def deviation(values: list[torch.Tensor], everyone: list[torch.Tensor]) -> float:
    """The largest distance of ``values`` from the mean of ``everyone`` (∞-norm)."""
    mean = torch.stack(everyone).double().mean(0)
    return max(float((v.double() - mean).abs().max()) for v in values)


# -- full fidelity: every peer runs the real node and averager ---------------------------------


class CountingStateServer(StateServer):
    """The real donor side, counting the downloads it begins."""

    served: Counter[str] = Counter()
    owner = ""

    async def on_begin(self, link: Any, frame: Frame) -> Frame:
        CountingStateServer.served[self.owner] += 1
        return await super().on_begin(link, frame)


@dataclass
class Peer:
    host: str
    node: AsyncNode
    averager: DecentralizedAverager
    tensor: torch.Tensor
    client: bool
    joined_at: float
    original: bool
    first_averaged_at: float | None = None
    step: asyncio.Task[Any] | None = None


@dataclass
class SwarmResult:
    n: int
    d: int
    m: int
    rounds_to_mean: int | None  # first round after which every original survivor holds it
    deviations: list[float]
    steps: int = 0
    match_attempts: int = 0
    matched: int = 0
    match_seconds: list[float] = field(default_factory=list)
    group_sizes: list[int] = field(default_factory=list)
    failed_steps: int = 0
    newcomers: int = 0
    newcomer_seconds: list[float] = field(default_factory=list)
    max_donor_load: int = 0
    downloads: int = 0
    messages_per_peer_s: float = 0.0
    bytes_per_peer_s: float = 0.0
    store_records: float = 0.0
    store_bytes: float = 0.0


def _node_config(s: Settings, client: bool) -> NodeConfig:
    return NodeConfig(
        client_mode=client,
        gossip_period=s.gossip_period,
        member_ttl=10 * s.gossip_period,
        request_timeout=5.0,
        # no eavesdropper in memory: sealing every frame would only spend the cores
        encryption=False,
    )


async def _swarm(n: int, s: Settings) -> SwarmResult:
    loop = asyncio.get_running_loop()
    random.seed(s.seed)  # donors are drawn with the module's random
    torch.manual_seed(s.seed)
    net = DrawnLinkNetwork(seed=s.seed)
    rng = net.random
    d, m = grid_shape(n, s.group_size)
    CountingStateServer.served = Counter()
    peers: dict[str, Peer] = {}
    hosts = iter(range(10**9))

    def clock() -> float:
        return EPOCH + loop.time()

    def servers() -> list[Peer]:
        return [p for p in peers.values() if not p.client]

    async def add_peer(bits: str, value: torch.Tensor, *, original: bool) -> Peer:
        host = f"p{next(hosts)}"
        client = bool(peers) and rng.random() < s.client_share  # the first one serves
        node = AsyncNode(
            [],
            transport=net.add_host(host),
            config=_node_config(s, client),
            clock=clock,
            seed=rng.randrange(2**31),
            identity=Identity.from_private_bytes(rng.randbytes(32)),  # ids from the seed
        )
        await node.start(bootstrap=False)
        tensor = value.clone()

        class Server(CountingStateServer):
            owner = node.peer_id

        averager = DecentralizedAverager(
            [tensor],
            LoopHandle(node),
            start=False,
            prefix=PREFIX,
            target_group_size=m,
            min_group_size=2,
            initial_group_bits=bits,
            min_matchmaking_time=s.min_matchmaking_time,
            request_timeout=2.0,
            part_size_bytes=4 * s.numel,
            next_chunk_timeout=2.0,
            client_mode=client,
            state_server_factory=Server,
        )
        averager.run()
        driver = averager._driver
        assert driver is not None
        find_group = driver.find_group

        async def timed_find_group(*args: Any, **kwargs: Any) -> Any:
            began = loop.time()
            result.match_attempts += 1
            group = await find_group(*args, **kwargs)  # MatchmakingFailed passes through
            result.matched += 1
            result.match_seconds.append(loop.time() - began)
            result.group_sizes.append(group.size)
            return group

        driver.find_group = timed_find_group  # type: ignore[method-assign]
        peer = Peer(host, node, averager, tensor, client, loop.time(), original)
        peers[host] = peer
        return peer

    result = SwarmResult(n=n, d=d, m=m, rounds_to_mean=None, deviations=[])
    # the swarm: bootstrapped one peer at a time from one earlier server
    originals = []
    for i in range(n):
        value = torch.randn(s.numel)
        peer = await add_peer(grid_bits_at(i, d, m), value, original=True)
        originals.append(peer)
    # each from one earlier server, so the swarm is connected (no pair knowing only itself)
    for i, peer in enumerate(originals[1:], start=1):
        earlier = [p for p in originals[:i] if not p.client]
        peer.node.initial_peers = rng.choice(earlier).node.visible_addresses
    await asyncio.gather(*(p.node.bootstrap() for p in originals[1:]))
    await asyncio.sleep(5 * s.gossip_period)

    departed: set[str] = set()
    cells = all_cells(d, m)

    async def leave(peer: Peer) -> None:
        departed.add(peer.host)
        peers.pop(peer.host, None)
        net.crash(peer.host)
        if peer.step is not None:
            peer.step.cancel()
        for task in list(peer.averager._step_futures):  # the averager's own step tasks
            task.cancel()
        await peer.node.shutdown()

    async def run_step(peer: Peer, at: float) -> None:
        control = peer.averager.step(
            scheduled_time=EPOCH + at, timeout=s.round_period - 1.0, wait=False
        )
        assert isinstance(control, StepControl)
        result.steps += 1
        try:
            await asyncio.wrap_future(control._future)
        except StepFailed:
            result.failed_steps += 1
            return
        if peer.first_averaged_at is None:
            peer.first_averaged_at = loop.time()
            if not peer.original:
                result.newcomer_seconds.append(loop.time() - peer.joined_at)

    async def arrive() -> None:
        donors = servers()
        newcomer = await add_peer("", torch.zeros(s.numel), original=False)
        result.newcomers += 1
        newcomer.node.initial_peers = rng.choice(donors).node.visible_addresses
        await newcomer.node.bootstrap()
        await asyncio.sleep(2 * s.gossip_period)  # its membership and the donors' records
        pending: Any = newcomer.averager.load_state_from_peers(wait=False, timeout=10.0)
        loaded = await pending  # a task on this loop (LoopHandle)
        donor_bits = None
        if loaded is not None:
            result.downloads += 1
            metadata, tensors = loaded
            newcomer.tensor.copy_(tensors[0])
            if isinstance(metadata, dict) and isinstance(metadata.get("group_bits"), str):
                donor_bits = metadata["group_bits"]
        taken = {p.averager.get_group_bits() for p in peers.values() if p is not newcomer}
        newcomer.averager.set_group_bits(newcomer_cell(cells, taken, donor_bits, m, rng))

    t_gossip = loop.time()
    stats0 = (net.stats.messages, net.stats.bytes)
    for r in range(s.rounds):
        start = loop.time()
        at = start + s.min_matchmaking_time + 1.0
        present = list(peers.values())
        leaving = rng.sample(present, round(_churn(s, r) * n))
        mid = leaving[: len(leaving) // 2]
        for peer in leaving[len(leaving) // 2 :]:
            await leave(peer)
        for peer in peers.values():
            peer.step = loop.create_task(run_step(peer, at))
        for peer in mid:  # crash while the round's parts are in flight
            loop.call_at(at + rng.uniform(0.05, 0.5), _spawn, loop, leave(peer))
        arrivals = [loop.create_task(arrive()) for _ in leaving]
        await asyncio.sleep(s.round_period)
        await asyncio.gather(*arrivals, return_exceptions=True)
        survivors = [p.tensor for p in peers.values() if p.original]
        dev = deviation(survivors, [p.tensor for p in peers.values()])
        result.deviations.append(dev)
        if dev <= TOLERANCE and result.rounds_to_mean is None:
            result.rounds_to_mean = r + 1
    elapsed = loop.time() - t_gossip
    present = list(peers.values())
    result.messages_per_peer_s = (net.stats.messages - stats0[0]) / len(present) / elapsed
    result.bytes_per_peer_s = (net.stats.bytes - stats0[1]) / len(present) / elapsed
    result.store_records = statistics.mean(len(p.node.store_) for p in present)
    result.store_bytes = statistics.mean(p.node.store_.total_bytes for p in present)
    result.max_donor_load = max(CountingStateServer.served.values(), default=0)
    for peer in present:
        if peer.step is not None:
            peer.step.cancel()
        for task in list(peer.averager._step_futures):
            task.cancel()
    await asyncio.gather(*(p.node.shutdown() for p in present), return_exceptions=True)
    return result


def _churn(s: Settings, r: int) -> float:
    """The share leaving before round ``r``."""
    return s.churn if s.churn_rounds is None or r < s.churn_rounds else 0.0


def _spawn(loop: asyncio.AbstractEventLoop, coro: Any) -> None:
    loop.create_task(coro)


def simulate_swarm(n: int, settings: Settings = Settings()) -> SwarmResult:
    """The real protocol for ``n`` peers under churn (see the module docstring)."""
    return _run(_swarm(n, settings))


def _run(coro: Any) -> Any:
    loop = VirtualTimeLoop()
    try:
        return loop.run_until_complete(coro)
    finally:
        for task in asyncio.all_tasks(loop):
            task.cancel()
        loop.run_until_complete(asyncio.sleep(0))
        loop.close()


# -- sampled: Moshpit rounds on the real grid functions, exact group means ---------------------


@dataclass
class MoshpitResult:
    n: int
    d: int
    m: int
    rounds_to_mean: int | None
    deviations: list[float]
    groups_per_round: float


def simulate_moshpit(n: int, settings: Settings = Settings()) -> MoshpitResult:
    """Moshpit averaging for ``n`` peers under churn, on the real grid functions with each
    group's exact mean (see the module docstring). Before each round ``churn·n`` peers
    leave — half at once, half during the round's all-reduce, where they drop out of their
    group's mean — and as many arrive after it, each holding a random donor's values and
    taking a free cell in its donor's last group (:func:`newcomer_cell`)."""
    s = settings
    rng = random.Random(s.seed)
    gen = torch.Generator().manual_seed(s.seed)
    d, m = grid_shape(n, s.group_size)
    cells = all_cells(d, m)
    # peer id → (bits, values, original)
    peers: dict[int, tuple[str, torch.Tensor, bool]] = {
        i: (grid_bits_at(i, d, m), torch.randn(s.numel, generator=gen, dtype=torch.float64), True)
        for i in range(n)
    }
    ids = iter(range(n, 10**9))
    deviations: list[float] = []
    groups_seen = 0
    rounds_to_mean = None
    for r in range(s.rounds):
        leaving = rng.sample(sorted(peers), round(_churn(s, r) * n))
        mid = set(leaving[: len(leaving) // 2])
        for i in leaving[len(leaving) // 2 :]:
            del peers[i]
        groups: dict[str, list[int]] = {}
        for i, (bits, _, _) in peers.items():
            groups.setdefault(group_key(PREFIX, bits, m), []).append(i)
        groups_seen += len(groups)
        for members in groups.values():
            rng.shuffle(members)  # the order the leader accepted them in
            staying = [i for i in members if i not in mid]
            if len(staying) < 2:
                continue  # no group: the step fails, values and bits stay
            mean = torch.stack([peers[i][1] for i in staying]).mean(0)
            group_id = rng.randbytes(16)
            for index, i in enumerate(staying):
                bits, _, original = peers[i]
                slot = slot_in_group(group_id, index, len(staying), m)
                if slot < 2 ** bits_per_coordinate(m):
                    bits = next_group_bits(bits, slot, m)
                peers[i] = (bits, mean.clone(), original)
        for i in mid:
            del peers[i]
        taken = {bits for bits, _, _ in peers.values()}
        donors = sorted(peers)
        for _ in leaving:
            donor = peers[rng.choice(donors)]
            cell = newcomer_cell(cells, taken, donor[0], m, rng)
            taken.add(cell)
            peers[next(ids)] = (cell, donor[1].clone(), False)
        survivors = [v for _, v, original in peers.values() if original]
        dev = deviation(survivors, [v for _, v, _ in peers.values()])
        deviations.append(dev)
        if dev <= TOLERANCE and rounds_to_mean is None:
            rounds_to_mean = r + 1
    return MoshpitResult(n, d, m, rounds_to_mean, deviations, groups_seen / max(1, s.rounds))


# -- gossip at full fidelity for every N: steady state of a converged swarm --------------------


@dataclass
class GossipResult:
    n: int
    live: int  # nodes run (the others quiet members, see the module docstring)
    messages_per_peer_s: float
    bytes_per_peer_s: float
    store_records: float
    store_bytes: float


async def _gossip(n: int, s: Settings) -> GossipResult:
    loop = asyncio.get_running_loop()
    net = DrawnLinkNetwork(seed=s.seed)
    rng = net.random
    live = min(n, s.gossip_live)
    config = NodeConfig(gossip_period=s.gossip_period, encryption=False)  # real member_ttl

    def clock() -> float:
        return EPOCH + loop.time()

    nodes = []
    for i in range(live):
        client = i > 0 and rng.random() < s.client_share
        node = AsyncNode(
            [],
            transport=net.add_host(f"g{i}"),
            config=replace(config, client_mode=client),
            clock=clock,
            seed=rng.randrange(2**31),
        )
        await node.start(bootstrap=False)
        nodes.append(node)
    # the other members, quiet: their membership records (client mode: nobody dials them)
    # live and are refreshed as a node of an N-peer swarm does its own (a third of the
    # membership TTL for N peers, :func:`peer.node.cost.membership_ttl`), each time entering
    # the swarm at one random live node, and anti-entropy carries them to everyone
    ttl = membership_ttl(config.member_ttl, n, config.max_record_ttl)
    refresh = max(config.gossip_period, ttl / 3)
    quiet = [Identity() for _ in range(n - live)]
    seq = dict.fromkeys(range(len(quiet)), 0)

    def quiet_record(k: int, now: float) -> Record:
        seq[k] += 1
        value = {"addresses": [], "client_mode": True}
        identity = quiet[k]
        return Record.create(identity, MEMBERS_KEY, identity.peer_id, value, now + ttl, seq=seq[k])

    # converged: every store holds every membership record (what gossip reaches anyway,
    # measured by bench/gossip.py --sim; here only the steady state counts)
    now = clock()
    records = [r for node in nodes for r in node.store_.records(MEMBERS_KEY, now)]
    published = [now - rng.uniform(0, refresh) for _ in quiet]
    records += [quiet_record(k, at) for k, at in enumerate(published)]
    taken = [now] * (len(records) - len(quiet)) + published  # quiet ones: old news
    for node in nodes:
        for record, at in zip(records, taken, strict=True):
            node.store_.put(record, at)
    due = sorted((r.expiration - ttl + refresh, k) for k, r in enumerate(records[live:]))

    async def republish() -> None:
        while True:
            await asyncio.sleep(0.25)
            now = clock()
            while due and due[0][0] <= now:
                _, k = due.pop(0)
                rng.choice(nodes).store_.put(quiet_record(k, now), now)
                due.append((now + refresh, k))

    task = loop.create_task(republish())
    await asyncio.sleep(2 * s.gossip_period)  # links open, the first rounds run
    before = (net.stats.messages, net.stats.bytes)
    await asyncio.sleep(s.gossip_window)
    messages = (net.stats.messages - before[0]) / live / s.gossip_window
    sent = (net.stats.bytes - before[1]) / live / s.gossip_window
    result = GossipResult(
        n,
        live,
        messages,
        sent,
        statistics.mean(len(node.store_) for node in nodes),
        statistics.mean(node.store_.total_bytes for node in nodes),
    )
    task.cancel()
    await asyncio.gather(*(node.shutdown() for node in nodes), return_exceptions=True)
    return result


def simulate_gossip(n: int, settings: Settings = Settings()) -> GossipResult:
    """Steady gossip of ``n`` real nodes whose stores hold the converged membership."""
    return _run(_gossip(n, settings))


# -- the table --------------------------------------------------------------------------------


@dataclass
class Row:
    n: int
    grid: str
    bound: int  # ⌈log_g N⌉
    rounds_still: int | None  # Moshpit rounds to the mean without churn
    rounds_churn: int | None  # ... with churn
    dev_at_bound: float  # with churn, after ⌈log_g N⌉ + 1 rounds
    rounds_calm: int | None  # ... once churn stops after ⌈log_g N⌉ + 1 rounds of it
    swarm: SwarmResult
    swarm_sampled: bool
    gossip: GossipResult


def fit_slope(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """Least-squares ``y = a + b·x``: ``(b, R²)``."""
    mx, my = statistics.mean(xs), statistics.mean(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sxx
    a = my - b * mx
    ss_res = sum((y - a - b * x) ** 2 for x, y in zip(xs, ys, strict=True))
    ss_tot = sum((y - my) ** 2 for y in ys) or 1.0
    return b, 1 - ss_res / ss_tot


def measure(sizes: list[int], s: Settings, full_max: int, log: Any = print) -> list[Row]:
    rows = []
    swarms: dict[int, SwarmResult] = {}
    for n in sizes:
        d, m = grid_shape(n, s.group_size)
        wall = time.monotonic()
        still = simulate_moshpit(n, replace(s, churn=0.0, rounds=4 * d + 4))
        churned = simulate_moshpit(n, replace(s, rounds=4 * d + 4))
        calm = simulate_moshpit(n, replace(s, rounds=4 * d + 4, churn_rounds=d + 1))
        sample = min(n, full_max)
        if sample not in swarms:
            swarms[sample] = simulate_swarm(sample, replace(s, rounds=d + 2))
        gossip = simulate_gossip(n, s)
        dev = churned.deviations[min(d, len(churned.deviations) - 1)]
        rows.append(
            Row(
                n,
                f"{m}^{d}",
                d,
                still.rounds_to_mean,
                churned.rounds_to_mean,
                dev,
                None if calm.rounds_to_mean is None else calm.rounds_to_mean - (d + 1),
                swarms[sample],
                sample != n,
                gossip,
            )
        )
        log(f"  N={n}: done in {time.monotonic() - wall:.0f} s of wall time", file=sys.stderr)
    return rows


def _rounds(r: int | None, limit: int) -> str:
    return f"{r}" if r is not None else f">{limit}"


def print_table(rows: list[Row], s: Settings, full_max: int) -> None:
    g = s.group_size
    print(
        f"\nMoshpit averaging, groups of at most g={g}, churn {s.churn:.0%} per round, "
        f"{s.client_share:.0%} client-mode peers; * = from a full-protocol swarm of "
        f"min(N, {full_max}) peers"
    )
    header = (
        f"{'N':>5} {'grid':>5} {'⌈log_g N⌉':>9} {'rounds':>6} {'churn':>6} {'dev@+1':>8} "
        f"{'calm':>5} "
        f"{'mm ok':>7} {'mm p50 s':>8} {'failed':>7} {'new→avg s':>9} {'donor max':>9} "
        f"{'msg/p/s':>7} {'KiB/p/s':>7} {'store':>6} {'st KiB':>6}"
    )
    print(header)
    for row in rows:
        sw = row.swarm
        tag = "*" if row.swarm_sampled else " "
        ok = sw.matched / max(1, sw.match_attempts)
        failed = sw.failed_steps / max(1, sw.steps)
        mm = statistics.median(sw.match_seconds) if sw.match_seconds else float("nan")
        new = statistics.median(sw.newcomer_seconds) if sw.newcomer_seconds else float("nan")
        limit = 4 * row.bound + 4
        print(
            f"{row.n:>5} {row.grid:>5} {row.bound:>9} {_rounds(row.rounds_still, limit):>6} "
            f"{_rounds(row.rounds_churn, limit):>6} {row.dev_at_bound:>8.1e} "
            f"{_rounds(row.rounds_calm, limit - row.bound - 1):>5} "
            f"{ok:>6.1%}{tag} {mm:>7.2f}{tag} {failed:>6.1%}{tag} {new:>8.1f}{tag} "
            f"{sw.max_donor_load:>3}/{sw.downloads:<4}{tag} "
            f"{row.gossip.messages_per_peer_s:>7.1f} {row.gossip.bytes_per_peer_s / 1024:>7.1f} "
            f"{row.gossip.store_records:>6.0f} {row.gossip.store_bytes / 1024:>6.0f}"
        )
    print(
        "rounds: Moshpit rounds until every peer present throughout holds the global mean "
        f"within {TOLERANCE:g} (no churn | with churn); dev@+1: its largest distance after "
        "⌈log_g N⌉ + 1 rounds with churn; calm: rounds to the mean once churn stops after "
        "those; mm ok: matchmaking attempts that found a group; "
        "failed: steps that failed; donor max: downloads served by the most-asked donor / "
        "all downloads; store: records and KiB of a peer's gossip store"
    )
    seen = set()
    for row in rows:
        sw = row.swarm
        if id(sw) in seen:
            continue
        seen.add(id(sw))
        spread = " ".join(f"{dev:.1e}" for dev in sw.deviations)
        print(
            f"the real protocol, {sw.n} peers on {sw.m}^{sw.d} with churn: the survivors' "
            f"distance from the mean after each round: {spread}"
        )
    if len(rows) >= 3:  # two points fit any curve
        ns = [float(r.n) for r in rows]
        ys = [r.gossip.bytes_per_peer_s for r in rows]
        b_log, r2_log = fit_slope([math.log(n) for n in ns], ys)
        b_lin, r2_lin = fit_slope(ns, ys)
        growth = ys[-1] / ys[0]
        print(
            f"gossip bytes per peer per second, N {rows[0].n} → {rows[-1].n}: x{growth:.2f} "
            f"(log N grew x{math.log(ns[-1]) / math.log(ns[0]):.2f}, N x{ns[-1] / ns[0]:.0f}); "
            f"fit against log N: {b_log:.0f} B/s per e-fold (R² {r2_log:.3f}); "
            f"against N: {b_lin:.1f} B/s per peer (R² {r2_lin:.3f})"
        )
        verdict = "O(log N)" if r2_log >= r2_lin else "linear in N"
        print(f"  → grows {verdict} (the better fit)")
    live = {r.gossip.live for r in rows if r.gossip.live < r.n}
    if live:
        print(
            f"gossip above {min(live)} peers: {min(live)} nodes run, the other members' "
            "records refreshed at the nodes' own rate (see the module docstring)"
        )


def plot(rows: list[Row], s: Settings, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ns = [r.n for r in rows]
    fig, axes = plt.subplots(2, 2, figsize=(10, 7))
    ax = axes[0][0]
    limit = [4 * r.bound + 4 for r in rows]
    ax.plot(ns, [r.bound for r in rows], "k--", label="⌈log_g N⌉")
    ax.plot(
        ns,
        [r.rounds_still or lim for r, lim in zip(rows, limit, strict=True)],
        "o-",
        label="no churn",
    )
    ax.plot(
        ns,
        [r.rounds_churn or lim for r, lim in zip(rows, limit, strict=True)],
        "s-",
        label=f"{s.churn:.0%} churn",
    )
    ax.set(xscale="log", title="Moshpit rounds to the mean (1e-6)", xlabel="N")
    ax.legend()
    ax = axes[0][1]
    ax.plot(ns, [r.gossip.bytes_per_peer_s / 1024 for r in rows], "o-")
    ax.set(xscale="log", yscale="log", title="gossip KiB per peer per second", xlabel="N")
    ax = axes[1][0]
    ax.plot(ns, [r.gossip.store_bytes / 1024 for r in rows], "o-")
    ax.set(xscale="log", yscale="log", title="gossip store per peer (KiB)", xlabel="N")
    ax = axes[1][1]
    ax.plot(ns, [r.gossip.messages_per_peer_s for r in rows], "o-")
    ax.set(xscale="log", title="gossip messages per peer per second", xlabel="N")
    fig.tight_layout()
    fig.savefig(path)
    print(f"plot: {path}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--peers", type=int, action="append", help="a swarm size (repeatable)")
    parser.add_argument("--group-size", type=int, default=16)
    parser.add_argument("--churn", type=float, default=0.10, help="share leaving per round")
    parser.add_argument("--clients", type=float, default=0.10, help="share in client mode")
    parser.add_argument("--full-max", type=int, default=100, help="largest full-protocol swarm")
    parser.add_argument("--gossip-live", type=int, default=100, help="gossip nodes run")
    parser.add_argument("--plot", default="scale.png", help="PNG path ('' for none)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    sizes = sorted(set(args.peers or SIZES))
    if any(n < 2 for n in sizes) or args.group_size < 2:
        parser.error("need at least 2 peers and a group size of at least 2")
    if not 0 <= args.churn < 1 or not 0 <= args.clients < 1:
        parser.error("--churn and --clients are shares from 0 to below 1")
    if args.full_max < 4 or args.gossip_live < 2:
        parser.error("--full-max must be at least 4 and --gossip-live at least 2")
    settings = Settings(
        group_size=args.group_size,
        churn=args.churn,
        client_share=args.clients,
        gossip_live=args.gossip_live,
        seed=args.seed,
    )
    wall = time.monotonic()
    rows = measure(sizes, settings, args.full_max)
    print_table(rows, settings, args.full_max)
    if args.plot and len(rows) >= 2:
        plot(rows, settings, args.plot)
    print(f"wall time: {time.monotonic() - wall:.0f} s")
    return 0


if __name__ == "__main__":
    logging.disable(logging.WARNING)  # peers crash on purpose: their neighbours' warnings
    sys.exit(main())
