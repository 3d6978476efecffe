"""The butterfly round's fault handling, without sockets: Hypothesis over interleavings.

Several :class:`AllreduceRunner` run in one event loop in virtual time, linked by an
in-process network: each link has a speed, each frame a random delay, and frames stay in
order per direction and channel, as streams would (parts and averages on a lane, the rest
on the link, which may overtake them). A member may hold NaN in its values, and another may
stop once it has sent some frames: killed (its tasks cancelled, frames to it refused) or
frozen (nothing to or from it moves any more). Whatever happens, every member that stays and
holds finite values ends with, part by part, either its own values or the exact mean of
some of the members' values (those the part's reducer accepted), never anything else;
without faults, the mean of all. No round hangs.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import math
import random
from dataclasses import dataclass
from typing import Any

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from peer.averaging.allreduce.partition import FlatLayout, Partition
from peer.averaging.allreduce.runner import AllreduceConfig, AllreduceRunner, MemberInfo
from peer.averaging.matchmaking.machine import GroupInfo
from peer.averaging.protocol import AVERAGE, PART
from peer.compression import NoCompression
from peer.exceptions import TransportError
from peer.wire import Frame
from swarmlab.sim import VirtualTimeLoop

PART_BYTES = 64  # 16 float32 values a part: several parts per span
DEADLINE = 120.0  # virtual seconds: far beyond the timeouts, a round must end before


class Net:
    """Delivers frames between runners after random delays, in order per direction."""

    def __init__(self, rng: random.Random, max_delay: float) -> None:
        self.rng = rng
        self.max_delay = max_delay
        self.runners: dict[str, AllreduceRunner] = {}
        self.dead: set[str] = set()  # killed: frames to it are refused
        self.frozen: set[str] = set()  # stopped (SIGSTOP): frames to it wait forever
        self._last: dict[tuple[str, str, bool], float] = {}
        self._rates: dict[tuple[str, str], float] = {}
        self.sent: collections.Counter[str] = collections.Counter()
        self.on_send: Any = None  # called with the sender's id after each frame it sends

    async def send(self, src: str, dst: str, frame: Frame) -> None:
        """Take the frame at once (a socket with room in its buffer), then yield."""
        if dst in self.dead or src in self.dead:
            raise TransportError(f"{dst} is gone")
        if dst in self.frozen or src in self.frozen:
            await asyncio.get_running_loop().create_future()  # its socket never drains
        self.sent[src] += 1
        if self.on_send is not None:
            self.on_send(src)
        loop = asyncio.get_running_loop()
        # the bytes as they are now (a stream copies them when sent)
        payload = bytearray(memoryview(frame.payload).cast("B")) if frame.payload else b""
        copy = Frame(frame.type, dict(frame.fields), payload)
        # in order per direction and channel: parts and averages travel on a bulk lane, other
        # frames on the link, and one may overtake the other
        channel = (src, dst, frame.type in (PART, AVERAGE))
        # each link has its own speed: a frame takes its size over that rate to go out
        rate = self._rates.setdefault((src, dst), self.rng.choice((1e3, 1e5, 1e7)))
        start = max(loop.time(), self._last.get(channel, 0))
        sent_at = start + len(payload) / rate
        self._last[channel] = sent_at
        loop.call_at(sent_at + self.rng.uniform(0, self.max_delay), self._deliver, src, dst, copy)
        await asyncio.sleep(sent_at - loop.time())

    def _deliver(self, src: str, dst: str, frame: Frame) -> None:
        runner = self.runners.get(dst)
        if runner is None or {src, dst} & (self.dead | self.frozen):
            return
        if runner.started:
            runner.on_frame(src, frame)
        else:
            runner.early.append((src, frame))


class _Link:
    def __init__(self, net: Net, src: str, dst: str) -> None:
        self.net, self.src, self.peer_id, self.closed = net, src, dst, False

    async def send(self, frame: Frame) -> None:
        await self.net.send(self.src, self.peer_id, frame)


class _Core:
    """The part of a node a round uses (``peer.averaging.seam.NodeCore``)."""

    bulk = None

    def __init__(self, net: Net, peer_id: str) -> None:
        self.net, self.peer_id = net, peer_id

    def now(self) -> float:
        return asyncio.get_running_loop().time()

    async def link(self, peer_id: str) -> _Link:
        if peer_id in self.net.dead:
            raise TransportError(f"{peer_id} is gone")
        return _Link(self.net, self.peer_id, peer_id)

    async def send(self, peer_id: str, frame: Frame) -> None:
        await self.net.send(self.peer_id, peer_id, frame)


def _allowed(got: torch.Tensor, own: torch.Tensor, values: list[torch.Tensor]) -> bool:
    """``got`` is ``own`` or the mean of some of ``values`` (all finite)."""
    if not torch.isfinite(got).all():
        return False
    if torch.allclose(got, own, atol=1e-5, rtol=0):
        return True
    for k in range(1, len(values) + 1):
        for subset in itertools.combinations(values, k):
            mean = torch.stack(subset).mean(dim=0)
            if torch.isfinite(mean).all() and torch.allclose(got, mean, atol=1e-5, rtol=0):
                return True
    return False


@dataclass
class Outcome:
    ids: list[str]
    outcomes: dict[str, Any]  # "ok", "died" or the exception its step raised
    local: dict[str, torch.Tensor]  # each member's values before the round
    results: dict[str, torch.Tensor]  # each member's values after it, if its step succeeded
    partition: Partition


async def _round(
    n: int,
    numel: int,
    seed: int,
    in_place: bool,
    nan_at: tuple[int, int] | None,
    death: tuple[int, int, bool] | None,
    max_delay: float,
) -> Outcome:
    rng = random.Random(seed)
    net = Net(rng, max_delay)
    ids = [f"peer{i}" for i in range(n)]
    gen = torch.Generator().manual_seed(seed)
    local = {p: torch.randint(-8, 9, (numel,), generator=gen).float() for p in ids}
    if nan_at is not None:
        local[ids[nan_at[0]]][nan_at[1] % numel] = math.nan
    flats = {p: local[p].clone() for p in ids}
    group = GroupInfo(b"g" * 8, "key", ids[0], tuple(ids), (b"",) * n, (False,) * n)
    members = [MemberInfo(p, False, 1.0, False, weight=1.0) for p in ids]
    config = AllreduceConfig(part_size_bytes=PART_BYTES, sender_timeout=1.0, reducer_timeout=2.0)
    for p in ids:
        net.runners[p] = AllreduceRunner(
            _Core(net, p),  # type: ignore[arg-type]
            "test",
            group,
            members,
            FlatLayout.from_tensors([flats[p]]),
            flats[p],
            weight=1.0,
            compression=NoCompression(),
            roles=None,
            config=config,
            in_place=in_place,
        )
    outcomes: dict[str, Any] = {}

    async def run(p: str) -> None:
        runner = net.runners[p]
        try:
            await runner.run()
            outcomes[p] = "ok"
        except asyncio.CancelledError:
            outcomes[p] = "died"
            raise
        except Exception as exc:  # a failed step: the member leaves and says so
            outcomes[p] = exc
            await runner.abort(str(exc))

    tasks = {p: asyncio.create_task(run(p)) for p in ids}
    if death is not None:
        victim, frames, frozen = ids[death[0]], death[1], death[2]

        def die() -> None:
            if frozen:
                net.frozen.add(victim)  # its tasks stay, but nothing moves any more
            elif victim not in net.dead:
                net.dead.add(victim)  # what it sent and is still under way is lost too
                tasks[victim].cancel()

        def count(src: str) -> None:
            if src == victim and net.sent[src] >= frames:
                asyncio.get_running_loop().call_soon(die)

        net.on_send = count
        if frames == 0:
            asyncio.get_running_loop().call_soon(die)
    _, pending = await asyncio.wait(tasks.values(), timeout=DEADLINE)
    for task in pending:
        task.cancel()
    hung = [p for p, t in tasks.items() if t in pending and p not in net.dead | net.frozen]
    assert not hung, f"rounds that did not end: {hung}"
    results = {
        p: flats[p] if in_place else local[p] + flats[p] for p in ids if outcomes.get(p) == "ok"
    }
    return Outcome(ids, outcomes, local, results, net.runners[ids[0]].round.partition)


@settings(
    max_examples=300,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
    derandomize=True,
)
@given(
    n=st.integers(2, 5),
    numel=st.integers(1, 120),
    seed=st.integers(0, 2**16),
    in_place=st.booleans(),
    nan_at=st.none() | st.tuples(st.integers(0, 4), st.integers(0, 10_000)),
    # a member killed, or frozen, once it has sent this many frames
    death=st.none() | st.tuples(st.integers(0, 4), st.integers(0, 12), st.booleans()),
    max_delay=st.sampled_from([0.0, 0.001, 0.05]),
)
def test_every_staying_member_ends_with_its_own_values_or_an_exact_mean(
    n: int,
    numel: int,
    seed: int,
    in_place: bool,
    nan_at: tuple[int, int] | None,
    death: tuple[int, int, bool] | None,
    max_delay: float,
) -> None:
    if nan_at is not None:
        nan_at = (nan_at[0] % n, nan_at[1])
    if death is not None:
        death = (death[0] % n, death[1], death[2])
        if nan_at is not None and death[0] == nan_at[0]:
            death = None
    loop = VirtualTimeLoop()
    try:
        out = loop.run_until_complete(_round(n, numel, seed, in_place, nan_at, death, max_delay))
    finally:
        loop.close()
    ids, outcomes, local, results = out.ids, out.outcomes, out.local, out.results
    bad = ids[nan_at[0]] if nan_at is not None else None
    victim = ids[death[0]] if death is not None else None
    for p in ids:
        if p in (bad, victim):
            continue
        assert outcomes[p] == "ok", (p, outcomes[p])
    if bad is not None and victim is None:
        # (a reducer that dies before it checks the NaN's part cannot report it: the NaN
        # then stays where it was, in the bad member's own values only)
        assert outcomes[bad] != "ok", "a member holding NaN fails its step"
    values = [local[p] for p in ids]
    for p, result in results.items():
        if p == bad:
            continue
        for r in range(n):
            for part in out.partition.parts_of(r):
                got = part.view(result)
                own = part.view(local[p])
                slices = [part.view(v) for v in values]
                assert _allowed(got, own, slices), (p, r, got, own, outcomes)
        if bad is None and victim is None:
            assert torch.allclose(result, torch.stack(values).mean(dim=0), atol=1e-5, rtol=0)
