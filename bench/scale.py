"""A whole swarm in virtual time: how matchmaking, Moshpit averaging, gossip and state
downloads hold from 50 to 1,000 peers.

    python bench/scale.py --peers 1000         # one size: the table, in under 10 minutes
    python bench/scale.py                      # N = 50, 100, 250, 500, 1000, table + PNG
    python bench/scale.py --peers 100 --full-max 100   # the real protocol for every peer

Every peer is a real :class:`~peer.node.AsyncNode` on the in-memory transport, on the one
virtual-time loop of :mod:`swarmlab.sim` (time jumps to the next timer whenever every peer waits, so
the figures are protocol time, not this machine's). Each host draws its access link (one-way latency
5-80 ms, bandwidth 1-100 MB/s, log-uniform; a message pays both ends' latency, at the slower end's
bandwidth); a share of the peers are in client mode (they dial out only). Every round each present
peer places itself on the Moshpit grid that fits the membership its node sees
(``DecentralizedAverager.place_on_grid`` with the grid of :mod:`peer.averaging.matchmaking.grid`:
``⌈log_g N⌉`` dimensions, or one more where N forbids it, full, with extras and slab weights) and
calls the real averager's ``step`` with the place's weight (gossip declarations, the matchmaking
state machine and its driver, the butterfly round and its runner, exclusion of the dead). Churn:
before each round a share of the peers leave (half of them crash in the middle of the round's
all-reduce, the others between rounds) and as many newcomers arrive, each bootstrapping from one
peer and downloading the state with ``load_state_from_peers`` (counted per donor); they take their
places from their own views in the next round.

What is reported: without churn, the rounds until every peer holds the global mean within
1e-6; with churn (``--churn-rounds`` rounds of it, then none), the survivors' distance from
the mean of the peers present after each round (∞-norm, the largest over survivors and
coordinates; survivors are the peers present before and after the round), the factor by
which it shrinks per round (median and smallest of the churn rounds, pooled over
``--model-runs`` runs of the model, as one run's median of ten rounds is noisy: each run's
own is printed too) and the rounds until it is under 1e-6 once churn stops.

What is sampled, and why
------------------------
Two cores cannot run the whole protocol for 1,000 peers in 10 minutes: every peer's gossip
rounds compare digests of the whole membership, so the swarm's gossip CPU grows as N², and
on top of it run N averagers. So, above ``--full-max`` peers (default 100):

* **gossip** still runs for all N real nodes (stores seeded with the converged membership,
  then measured over a steady window): messages and bytes per peer per second and the
  store size per peer are full-fidelity at every N;
* **Moshpit rounds** use the real places, keys and weights of :mod:`peer.averaging.matchmaking.grid`
  and :mod:`peer.averaging.matchmaking.group_bits` with each group's exact weighted mean — what the
  butterfly computes, which the full tier checks to 1e-6 — and the same churn (a peer that dies
  mid-round drops out of its group's mean, as the runner excludes it); each peer sees the exact
  membership (no gossip lag, which the full tier has) and keeps its cell from round to round
  (:func:`~peer.averaging.matchmaking.grid.place_next`), and a newcomer takes its state from a
  peer of its slab (:func:`slab_mates`) and its cell from the cells the others claim
  (:func:`~peer.averaging.matchmaking.grid.with_claims`), as the full tier's averagers do
  (``DecentralizedAverager.place_on_grid``, over gossip);
* **matchmaking, failed rounds, newcomers and donors** come from a full-fidelity swarm of
  ``--full-max`` peers (its own grid, of sides ``≤ g`` like every size's): a peer's
  matchmaking sees only the peers of its key and a newcomer's download touches one donor,
  so those figures depend on the group size and the churn rate rather than on N; the
  table marks them ``*``.
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
from peer.averaging.matchmaking.grid import (
    Grid,
    GridHistory,
    Placement,
    claim,
    grid_for,
    home_coordinate,
    place_next,
    with_claims,
)
from peer.averaging.matchmaking.group_bits import group_key
from peer.averaging.sharing.download import StateServer
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
    churn_run: int = 10  # the table's run: rounds with churn before the calm ones
    model_runs: int = 8  # the model's churn runs (seeds seed, seed + 1, …), pooled
    full_rounds: int = 4  # rounds of the full-protocol swarm (churn in every one)
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


def grid_label(grid: Grid) -> str:
    """``10x10``, ``6x6+1``: the sides, dimension 0 first, and the extras."""
    sides = "x".join(str(side) for side in grid.sides)
    return f"{sides}+{len(grid.extras)}" if grid.extras else sides


def slab_mates(
    placement: Placement, donors: list[str], newcomers: list[str], round_index: int
) -> dict[str, list[str]]:
    """For each newcomer, the donors whose state it wants for its first round,
    ``round_index``: those at its :func:`~peer.averaging.matchmaking.grid.home_coordinate`
    along that round's dimension, where :func:`~peer.averaging.matchmaking.grid.place_all`
    places it if a cell there is free. After the rounds on the other dimensions they hold
    the mean of the slab its cell belongs to, the value the peer that left that cell would
    have brought."""
    grid = placement.grid
    dim = round_index % grid.dims
    at: dict[int, list[str]] = {}
    for p in donors:
        at.setdefault(grid.coords(placement.cells[p])[dim], []).append(p)
    return {new: at.get(home_coordinate(new, grid, dim), []) for new in newcomers}


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
    grid: Grid
    rounds_to_mean: int | None  # first round after which every survivor holds it
    deviations: list[float]  # the survivors' distance from the mean after each round
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
    CountingStateServer.served = Counter()
    peers: dict[str, Peer] = {}
    hosts = iter(range(10**9))

    def clock() -> float:
        return EPOCH + loop.time()

    def servers() -> list[Peer]:
        return [p for p in peers.values() if not p.client]

    async def add_peer(value: torch.Tensor, *, original: bool) -> Peer:
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

        class Averager(DecentralizedAverager):
            state_server_class = Server

        averager = Averager(
            [tensor],
            LoopHandle(node),
            start=False,
            prefix=PREFIX,
            target_group_size=s.group_size,
            min_group_size=2,
            min_matchmaking_time=s.min_matchmaking_time,
            request_timeout=2.0,
            part_size_bytes=4 * s.numel,
            next_chunk_timeout=2.0,
            client_mode=client,
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

    result = SwarmResult(n=n, grid=grid_for(n, s.group_size), rounds_to_mean=None, deviations=[])
    # the swarm: bootstrapped one peer at a time from one earlier server
    originals = []
    for _ in range(n):
        value = torch.randn(s.numel)
        peer = await add_peer(value, original=True)
        originals.append(peer)
    # each from one earlier server, so the swarm is connected (no pair knowing only itself)
    for i, peer in enumerate(originals[1:], start=1):
        earlier = [p for p in originals[:i] if not p.client]
        peer.node.gossip.initial_peers = rng.choice(earlier).node.visible_addresses
    await asyncio.gather(*(p.node.bootstrap() for p in originals[1:]))
    # every peer places itself from the membership it sees: start once the views are whole
    for _ in range(60):
        await asyncio.sleep(s.gossip_period)
        if all(len(p.node.members()) == n for p in originals):
            break
    await asyncio.sleep(2 * s.gossip_period)

    departed: set[str] = set()

    async def leave(peer: Peer) -> None:
        departed.add(peer.host)
        peers.pop(peer.host, None)
        net.crash(peer.host)
        if peer.step is not None:
            peer.step.cancel()
        for task in list(peer.averager._step_futures):  # the averager's own step tasks
            task.cancel()
        await peer.node.shutdown()

    async def run_step(peer: Peer, r: int, at: float) -> None:
        weight = peer.averager.place_on_grid(peer.node.members(), r)
        control = peer.averager.step(
            scheduled_time=EPOCH + at, weight=weight, timeout=s.round_period - 1.0, wait=False
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
        newcomer = await add_peer(torch.zeros(s.numel), original=False)
        result.newcomers += 1
        newcomer.node.gossip.initial_peers = rng.choice(donors).node.visible_addresses
        await newcomer.node.bootstrap()
        await asyncio.sleep(2 * s.gossip_period)  # its membership and the donors' records
        pending: Any = newcomer.averager.load_state_from_peers(wait=False, timeout=10.0)
        loaded = await pending  # a task on this loop (LoopHandle)
        if loaded is not None:
            result.downloads += 1
            newcomer.tensor.copy_(loaded[1][0])

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
            peer.step = loop.create_task(run_step(peer, r, at))
        for peer in mid:  # crash while the round's parts are in flight
            loop.call_at(at + rng.uniform(0.05, 0.5), _spawn, loop, leave(peer))
        stayed = set(peers)
        arrivals = [loop.create_task(arrive()) for _ in leaving]
        await asyncio.sleep(s.round_period)
        await asyncio.gather(*arrivals, return_exceptions=True)
        survivors = [p.tensor for host, p in peers.items() if host in stayed]
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
    grid: Grid
    rounds_to_mean: int | None  # first round after which every survivor holds the mean
    deviations: list[float]  # the survivors' distance from the mean after each round
    initial: float  # ... before the first round
    churn_rounds: int  # the rounds with churn (the first ones)

    def contraction(self) -> list[float]:
        """Per round with churn: the survivors' distance before it over after it."""
        before = [self.initial, *self.deviations]
        return [
            before[r] / max(self.deviations[r], 1e-300)
            for r in range(min(self.churn_rounds, len(self.deviations)))
        ]

    def rounds_after_churn(self) -> int | None:
        """Rounds after the last with churn until the survivors hold the mean (0: already)."""
        k = self.churn_rounds
        if k and self.deviations[k - 1] <= TOLERANCE:
            return 0
        return next(
            (r + 1 - k for r in range(k, len(self.deviations)) if self.deviations[r] <= TOLERANCE),
            None,
        )


def simulate_moshpit(n: int, settings: Settings = Settings()) -> MoshpitResult:
    """Moshpit averaging for ``n`` peers under churn, each peer placed on the grid of
    :mod:`peer.averaging.matchmaking.grid` from the membership of the round (exact views: the model
    has no gossip lag) with each group's exact weighted mean (see the module docstring).
    Before each round ``churn·n`` peers leave — half at once, half during the round's
    all-reduce, before their parts go out, so that they drop out of their group's mean —
    and as many arrive after it, each holding the values of a donor of the slab it will
    average for (:func:`slab_mates`; any donor if there is none) and taking its cell from
    the others' claims in its first round. The survivors are the peers present before and
    after the round; "the mean" is that of every peer present after it, newcomers
    included."""
    s = settings
    rng = random.Random(s.seed)
    gen = torch.Generator().manual_seed(s.seed)
    peers: dict[str, torch.Tensor] = {
        f"m{i}": torch.randn(s.numel, generator=gen, dtype=torch.float64) for i in range(n)
    }
    ids = iter(range(n, 10**9))
    # each peer's placement carried from round to round, and the cell each claims (a
    # newcomer starts from the placement the claims describe, as the averager does)
    history = dict.fromkeys(peers, GridHistory())
    claims: dict[str, list[int]] = {}
    placement: Placement | None = None
    deviations: list[float] = []
    initial = deviation(list(peers.values()), list(peers.values()))
    rounds_to_mean = None
    for r in range(s.rounds):
        leaving = rng.sample(sorted(peers), round(_churn(s, r) * n))
        mid = set(leaving[: len(leaving) // 2])
        for peer in leaving[len(leaving) // 2 :]:
            del peers[peer]
        view = frozenset(peers)  # the crashing ones are still there when the round begins
        groups: dict[str, list[tuple[str, float]]] = {}
        resumed = None
        for peer in sorted(peers):
            # with exact views every carried placement is what the claims say; a newcomer
            # resumes from them (the same for every newcomer of the round: none claims yet)
            if history[peer].placement is None:
                if resumed is None:
                    resumed = with_claims(GridHistory(), view, peer, s.group_size, r, claims)
                history[peer] = resumed
            place, history[peer] = place_next(history[peer], view, peer, s.group_size, r)
            claims[peer] = claim(place, r, claims.get(peer))
            placement = place.placement
            key = group_key(PREFIX, place.bits, s.group_size)
            groups.setdefault(key, []).append((peer, place.weight))
        for members in groups.values():
            staying = [(p, w) for p, w in members if p not in mid]
            if len(staying) < 2:
                continue  # no group: the step fails, values stay
            weights = torch.tensor([w for _, w in staying], dtype=torch.float64)
            stacked = torch.stack([peers[p] for p, _ in staying])
            mean = (stacked * weights[:, None]).sum(0) / weights.sum()
            for p, _ in staying:
                peers[p] = mean.clone()
        for peer in [*mid, *leaving]:
            peers.pop(peer, None)
            claims.pop(peer, None)  # gone: its claim no longer counts (not in any view)
        survivors = list(peers.values())
        donors = sorted(peers)
        assert placement is not None
        arriving = [f"m{next(ids)}" for _ in leaving]
        mates = slab_mates(placement, donors, arriving, r + 1)
        for newcomer in arriving:
            donor = rng.choice(mates[newcomer] or donors)
            peers[newcomer] = peers[donor].clone()
            history[newcomer] = GridHistory()
        dev = deviation(survivors, list(peers.values()))
        deviations.append(dev)
        if dev <= TOLERANCE and rounds_to_mean is None:
            rounds_to_mean = r + 1
    churn_rounds = s.rounds if s.churn_rounds is None else min(s.rounds, s.churn_rounds)
    return MoshpitResult(
        n,
        grid_for(n, s.group_size),
        rounds_to_mean,
        deviations,
        initial,
        churn_rounds if s.churn > 0 else 0,
    )


@dataclass
class ChurnSummary:
    """The model's churn figures over ``len(runs)`` runs (seeds ``seed``, ``seed + 1``, …):
    the contraction of every churn round of every run, pooled (one run's ten rounds give a
    noisy median: a round's factor ranges from about 2.5 to 8), and each run's own."""

    runs: list[MoshpitResult]

    @property
    def factors(self) -> list[float]:
        return [f for run in self.runs for f in run.contraction()]

    @property
    def median(self) -> float:
        return statistics.median(self.factors) if self.factors else math.nan

    @property
    def worst(self) -> float:
        return min(self.factors) if self.factors else math.nan

    @property
    def run_medians(self) -> list[float]:
        return [statistics.median(run.contraction()) for run in self.runs if run.contraction()]

    @property
    def rounds_after_churn(self) -> int | None:
        """The most rounds any run took to the mean once churn stopped (None: one never did)."""
        rounds = [run.rounds_after_churn() for run in self.runs]
        return None if any(r is None for r in rounds) else max(r for r in rounds if r is not None)


def churn_runs(n: int, settings: Settings) -> ChurnSummary:
    """:func:`simulate_moshpit` for ``settings.model_runs`` seeds from ``settings.seed``."""
    return ChurnSummary(
        [
            simulate_moshpit(n, replace(settings, seed=settings.seed + k))
            for k in range(max(1, settings.model_runs))
        ]
    )


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
    needed: int  # rounds the grid needs: the bound, or one more where N forbids it
    rounds_still: int | None  # Moshpit rounds to the mean without churn
    contraction_p50: float  # with churn: the survivors' distance shrinks by this per round
    contraction_worst: float  # (both over every churn round of the model's runs)
    run_medians: list[float]  # each run's own median
    rounds_calm: int | None  # once churn (for ⌈log_g N⌉ + 1 rounds) stops: rounds to 1e-6
    churned: MoshpitResult  # the first run, whose distances are printed and drawn
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


def log_g(n: int, g: int) -> int:
    """``⌈log_g n⌉`` in integers."""
    d = 0
    while g**d < n:
        d += 1
    return d


def measure(sizes: list[int], s: Settings, full_max: int, log: Any = print) -> list[Row]:
    rows = []
    swarms: dict[int, SwarmResult] = {}
    for n in sizes:
        grid = grid_for(n, s.group_size)
        d = grid.dims
        wall = time.monotonic()
        still = simulate_moshpit(n, replace(s, churn=0.0, rounds=d + 2))
        churned = churn_runs(
            n, replace(s, churn_rounds=s.churn_run, rounds=s.churn_run + 2 * d + 2)
        )
        # recovery: churn for d + 1 rounds leaves the survivors far apart (10 rounds of it
        # may leave them under 1e-6 already), then none; the slowest run counts
        calm = churn_runs(n, replace(s, churn_rounds=d + 1, rounds=3 * d + 3))
        sample = min(n, full_max)
        if sample not in swarms:
            swarms[sample] = simulate_swarm(
                sample, replace(s, rounds=s.full_rounds, churn_rounds=None)
            )
        gossip = simulate_gossip(n, s)
        rows.append(
            Row(
                n,
                grid_label(grid),
                log_g(n, s.group_size),
                d,
                still.rounds_to_mean,
                churned.median,
                churned.worst,
                churned.run_medians,
                calm.rounds_after_churn,
                churned.runs[0],
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
        f"\nMoshpit averaging, groups of at most g={g}, churn {s.churn:.0%} per round "
        f"({s.churn_run} rounds, then none; the model's figures over {max(1, s.model_runs)} "
        f"runs, seeds {s.seed}…{s.seed + max(1, s.model_runs) - 1}), "
        f"{s.client_share:.0%} client-mode peers; "
        f"* = from a full-protocol swarm of min(N, {full_max}) peers"
    )
    header = (
        f"{'N':>5} {'grid':>9} {'⌈log_g N⌉':>9} {'rounds':>6} {'x/round':>7} {'worst':>5} "
        f"{'calm':>4} "
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
        print(
            f"{row.n:>5} {row.grid:>9} {row.bound:>9} {_rounds(row.rounds_still, row.needed + 2):>6} "
            f"{row.contraction_p50:>7.1f} {row.contraction_worst:>5.1f} "
            f"{_rounds(row.rounds_calm, 2 * row.needed + 2):>4} "
            f"{ok:>6.1%}{tag} {mm:>7.2f}{tag} {failed:>6.1%}{tag} {new:>8.1f}{tag} "
            f"{sw.max_donor_load:>3}/{sw.downloads:<4}{tag} "
            f"{row.gossip.messages_per_peer_s:>7.1f} {row.gossip.bytes_per_peer_s / 1024:>7.1f} "
            f"{row.gossip.store_records:>6.0f} {row.gossip.store_bytes / 1024:>6.0f}"
        )
    print(
        "grid: sides (+ extras: a second peer in that many cells); rounds: Moshpit rounds "
        f"until every peer holds the global mean within {TOLERANCE:g} without churn; "
        "x/round, worst: with churn, the factor by which the survivors' distance from the "
        "mean of the peers present shrinks per round (median and smallest over every churn "
        "round of every run); calm: rounds "
        f"until it is under {TOLERANCE:g} once churn stops, after d + 1 rounds of it "
        "(d: the grid's dimensions; the slowest run); "
        "mm ok: matchmaking attempts that found a group; "
        "failed: steps that failed; donor max: downloads served by the most-asked donor / "
        "all downloads; store: records and KiB of a peer's gossip store"
    )
    for row in rows:
        if len(row.run_medians) > 1:
            print(
                f"N={row.n}: each run's own median x/round: {min(row.run_medians):.2f} to "
                f"{max(row.run_medians):.2f} over {len(row.run_medians)} runs"
            )
    for row in rows:
        spread = " ".join(f"{dev:.0e}" for dev in row.churned.deviations)
        print(f"N={row.n}: the survivors' distance after each round (model, first run): {spread}")
    seen = set()
    for row in rows:
        sw = row.swarm
        if id(sw) in seen:
            continue
        seen.add(id(sw))
        spread = " ".join(f"{dev:.1e}" for dev in sw.deviations)
        print(
            f"the real protocol, {sw.n} peers on {grid_label(sw.grid)} with churn: the "
            f"survivors' distance from the mean after each round: {spread}"
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
    ax.plot(ns, [r.bound for r in rows], "k--", label="⌈log_g N⌉")
    ax.plot(ns, [r.rounds_still or math.nan for r in rows], "o-", label="no churn")
    ax.plot(ns, [r.rounds_calm or 0 for r in rows], "s-", label="once churn stops")
    ax.set(xscale="log", title="Moshpit rounds to the mean (1e-6)", xlabel="N")
    ax.legend()
    ax = axes[0][1]
    for row in rows:
        ax.plot(
            range(1, len(row.churned.deviations) + 1), row.churned.deviations, label=f"N={row.n}"
        )
    ax.axvline(s.churn_run + 0.5, color="k", linestyle=":")
    ax.set(
        yscale="log",
        title=f"survivors' distance, {s.churn:.0%} churn until the dotted line",
        xlabel="round",
    )
    ax.legend(fontsize="small")
    ax = axes[1][0]
    ax.plot(ns, [r.contraction_p50 for r in rows], "o-", label="median")
    ax.plot(ns, [r.contraction_worst for r in rows], "s-", label="worst")
    ax.axhline(4, color="k", linestyle=":")
    ax.set(xscale="log", title="contraction per round under churn", xlabel="N")
    ax.legend()
    ax = axes[1][1]
    ax.plot(ns, [r.gossip.bytes_per_peer_s / 1024 for r in rows], "o-")
    ax.set(xscale="log", yscale="log", title="gossip KiB per peer per second", xlabel="N")
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
    parser.add_argument("--churn-rounds", type=int, default=10, help="rounds with churn")
    parser.add_argument("--clients", type=float, default=0.10, help="share in client mode")
    parser.add_argument("--full-max", type=int, default=100, help="largest full-protocol swarm")
    parser.add_argument("--gossip-live", type=int, default=100, help="gossip nodes run")
    parser.add_argument("--plot", default="scale.png", help="PNG path ('' for none)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--model-runs", type=int, default=8, help="churn runs of the model (seeds from --seed)"
    )
    args = parser.parse_args(argv)
    sizes = sorted(set(args.peers or SIZES))
    if any(n < 2 for n in sizes) or args.group_size < 2:
        parser.error("need at least 2 peers and a group size of at least 2")
    if not 0 <= args.churn < 1 or not 0 <= args.clients < 1:
        parser.error("--churn and --clients are shares from 0 to below 1")
    if args.churn_rounds < 1:
        parser.error("--churn-rounds must be at least 1")
    if args.full_max < 4 or args.gossip_live < 2:
        parser.error("--full-max must be at least 4 and --gossip-live at least 2")
    if args.model_runs < 1:
        parser.error("--model-runs must be at least 1")
    settings = Settings(
        group_size=args.group_size,
        churn=args.churn,
        churn_run=args.churn_rounds,
        client_share=args.clients,
        gossip_live=args.gossip_live,
        seed=args.seed,
        model_runs=args.model_runs,
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
