"""Survivors finish a dead reducer's span: the plan (no I/O), then real rounds of four
:class:`AllreduceRunner` in virtual time over an in-process network, one reducer killed."""

from __future__ import annotations

import asyncio
import random
from dataclasses import replace
from typing import Any

import pytest
import torch

from peer.averaging.allreduce.partition import FlatLayout, Partition
from peer.averaging.allreduce.recovery import Orphans, is_recovery_of, plan_recovery
from peer.averaging.allreduce.robust import aggregate
from peer.averaging.allreduce.runner import (
    MAX_RECOVERY_DEPTH,
    AllreduceConfig,
    AllreduceRunner,
    MemberInfo,
)
from peer.averaging.matchmaking.machine import GroupInfo
from peer.compression import NoCompression
from swarmlab.sim import VirtualTimeLoop
from tests.peer.averaging.test_round_properties import Net, _Core

IDS = ["peer0", "peer1", "peer2", "peer3"]
GROUP = GroupInfo(b"g" * 16, "key", IDS[0], tuple(IDS), (b"",) * 4, (False,) * 4)
MEMBERS = [MemberInfo(p, False, 1.0, False, weight=float(i + 1)) for i, p in enumerate(IDS)]


def _partition(numel: int = 64) -> Partition:
    return Partition(FlatLayout.from_tensors([torch.zeros(numel)]), [16, 16, 16, 16], 32)


def _orphans(parts: list[int]) -> Orphans:
    orphans = Orphans()
    for i in parts:
        orphans.keep(1, i, torch.zeros(1))
    return orphans


def test_survivors_that_agree_plan_the_same_recovery_round() -> None:
    partition = _partition()
    a = plan_recovery(GROUP, MEMBERS, partition, _orphans([0, 1]), {"peer1"})
    b = plan_recovery(GROUP, MEMBERS, partition, _orphans([0, 1]), {"peer1"})
    assert a is not None and b is not None
    assert a == b
    assert a.group.peer_ids == ("peer0", "peer2", "peer3")
    assert [m.peer_id for m in a.members] == ["peer0", "peer2", "peer3"]
    assert is_recovery_of(GROUP.group_id, a.group.group_id)
    assert not is_recovery_of(GROUP.group_id, GROUP.group_id)
    assert [(r, i) for r, i, _, _ in a.slots] == [(1, 0), (1, 1)]


def test_one_heir_reduces_every_open_part() -> None:
    # the first survivor that reduced a span: a part of the round is never split between
    # two reducers of the recovery (one of which may die too)
    # (nor is a client-mode or auxiliary member the heir: the first reduces nothing, the
    # second keeps its own tensors and runs no recovery)
    for other in (replace(MEMBERS[2], client_mode=True), replace(MEMBERS[2], auxiliary=True)):
        members = [MEMBERS[0], MEMBERS[1], other, MEMBERS[3]]
        plan = plan_recovery(GROUP, members, _partition(), _orphans([0]), {"peer0", "peer1"})
        assert plan is not None
        heirs = [(m.peer_id, m.bandwidth) for m in plan.members]
        assert heirs == [("peer2", 0.0), ("peer3", 1.0)]
    plan = plan_recovery(GROUP, MEMBERS, _partition(), _orphans([0]), {"peer1"})
    assert plan is not None
    assert [m.bandwidth for m in plan.members] == [1.0, 0.0, 0.0]  # peer0, the first


def test_survivors_that_disagree_do_not_meet() -> None:
    partition = _partition()
    plans = [
        plan_recovery(GROUP, MEMBERS, partition, _orphans([0, 1]), {"peer1"}),
        plan_recovery(GROUP, MEMBERS, partition, _orphans([1]), {"peer1"}),
        plan_recovery(GROUP, MEMBERS, partition, _orphans([0, 1]), {"peer1", "peer3"}),
    ]
    ids = {p.group.group_id for p in plans if p is not None}
    assert len(ids) == 3


def test_nothing_to_recover_or_nobody_to_recover_with() -> None:
    partition = _partition()
    assert plan_recovery(GROUP, MEMBERS, partition, Orphans(), {"peer1"}) is None
    alone = {"peer1", "peer2", "peer3"}
    assert plan_recovery(GROUP, MEMBERS, partition, _orphans([0]), alone) is None


async def _killed_reducer_round(
    numel: int,
    kill_after: int,
    in_place: bool,
    aggregator: str = "mean",
    heir_dies: bool = False,
    depth: int = 0,
) -> Any:
    net = Net(random.Random(7), 0.001)
    gen = torch.Generator().manual_seed(kill_after)
    # (close to each other, as honest copies of a model are)
    base = torch.randn(numel, generator=gen)
    local = {p: base + 0.01 * torch.randn(numel, generator=gen) for p in IDS}
    flats = {p: local[p].clone() for p in IDS}
    weights = {p: float(i + 1) if aggregator == "mean" else 1.0 for i, p in enumerate(IDS)}
    members = [replace(m, weight=weights[m.peer_id]) for m in MEMBERS]
    config = AllreduceConfig(
        part_size_bytes=64, sender_timeout=1.0, reducer_timeout=2.0, aggregator=aggregator
    )
    for p in IDS:
        net.runners[p] = AllreduceRunner(
            _Core(net, p),  # type: ignore[arg-type]
            "test",
            GROUP,
            members,
            FlatLayout.from_tensors([flats[p]]),
            flats[p],
            weight=weights[p],
            compression=NoCompression(),
            roles=None,
            config=config,
            in_place=in_place,
            depth=depth,
        )
    tasks = {p: asyncio.create_task(net.runners[p].run()) for p in IDS}

    def die(victim: str) -> None:
        if victim not in net.dead:
            net.dead.add(victim)
            tasks[victim].cancel()

    def count(src: str) -> None:
        if src == "peer1" and net.sent[src] >= kill_after:
            asyncio.get_running_loop().call_soon(die, src)
        if heir_dies and src == "peer0" and net.runners[src].recovery is not None:
            asyncio.get_running_loop().call_soon(die, src)  # the heir, as its recovery begins

    net.on_send = count
    await asyncio.wait(tasks.values(), timeout=120.0)
    survivors = [p for p in IDS if p not in net.dead]
    for p in survivors:
        assert tasks[p].done() and tasks[p].exception() is None, p
    results = {p: flats[p] if in_place else local[p] + flats[p] for p in survivors}
    return net, local, weights, results


def _in_virtual_time(*args: Any, **kwargs: Any) -> Any:
    """:func:`_killed_reducer_round` run on a virtual-time loop of its own."""
    loop = VirtualTimeLoop()
    try:
        return loop.run_until_complete(_killed_reducer_round(*args, **kwargs))
    finally:
        loop.close()


def _aggregate(name: str, values: torch.Tensor, weights: list[float]) -> torch.Tensor:
    out = aggregate(name, values, weights)
    assert out is not None
    return out


def _mean(names: frozenset[str], local: dict, weights: dict, start: int, stop: int) -> Any:
    total = sum(weights[p] for p in names)
    return sum(weights[p] * local[p][start:stop].double() for p in names) / total


@pytest.mark.parametrize("aggregator", ["mean", "centered_clip"])
@pytest.mark.parametrize("in_place", [True, False])
@pytest.mark.parametrize("kill_after", [3, 4, 5])
def test_survivors_of_a_killed_reducer_hold_the_same_values(
    kill_after: int, in_place: bool, aggregator: str
) -> None:
    # a reducer of four killed once it has sent kill_after frames: the three survivors
    # finish its span (with the round's aggregator) and end holding the same values
    net, local, weights, results = _in_virtual_time(200, kill_after, in_place, aggregator)
    survivors = ["peer0", "peer2", "peer3"]
    first = results[survivors[0]]
    for p in survivors[1:]:
        # in place, the very same values; a delta is added to each member's own (rounding)
        if in_place:
            assert torch.equal(results[p], first), f"{p} disagrees with {survivors[0]}"
        else:
            assert torch.allclose(results[p], first, atol=1e-6, rtol=0), p
    runner = net.runners["peer0"]
    partition = runner.round.partition
    start, stop = partition.spans[1]
    recovered = runner.included
    assert recovered, "the dead reducer's span was not finished by the survivors"
    # the recovery's vector: the open parts of each survivor back to back, in parts of 16
    # values (64 bytes), each aggregated by the heir with the round's rule
    got = torch.cat([first[lo:hi] for lo, hi in recovered])
    vectors = torch.stack([torch.cat([local[p][lo:hi] for lo, hi in recovered]) for p in survivors])
    expected = torch.cat(
        [
            _aggregate(aggregator, vectors[:, at : at + 16], [weights[p] for p in survivors])
            for at in range(0, vectors.shape[1], 16)
        ]
    )
    assert torch.allclose(got, expected, atol=1e-5)
    for (lo, hi), names in recovered.items():
        assert start <= lo < hi <= stop
        assert names == frozenset(survivors)
        if aggregator == "mean":  # the weighted mean of the contributions it names
            mean = _mean(names, local, weights, lo, hi)
            assert torch.allclose(first[lo:hi].double(), mean, atol=1e-5)
        for p in survivors:
            assert net.runners[p].included == recovered
            recovery = net.runners[p].recovery
            assert recovery is not None and recovery.config.aggregator == aggregator


@pytest.mark.parametrize("in_place", [True, False])
def test_when_the_heir_dies_too_the_next_one_finishes_its_parts(in_place: bool) -> None:
    net, local, weights, results = _in_virtual_time(200, 4, in_place, heir_dies=True)
    assert net.dead == {"peer0", "peer1"}
    first = results["peer2"]
    assert torch.allclose(results["peer3"], first, atol=1e-6, rtol=0)
    recovered = net.runners["peer2"].included
    assert recovered and net.runners["peer3"].included == recovered
    for (lo, hi), names in recovered.items():
        assert names == frozenset({"peer2", "peer3"})
        mean = _mean(names, local, weights, lo, hi)
        assert torch.allclose(first[lo:hi].double(), mean, atol=1e-5)


def test_recoveries_nest_at_most_max_recovery_depth_deep() -> None:
    """A round that is itself a recovery that deep (heir after heir gave up: most likely the
    others run another recovery and never meet this one) starts none: the dead reducer's
    parts keep each member's own values, and the round ends."""
    net, _, _, results = _in_virtual_time(200, 4, True, depth=MAX_RECOVERY_DEPTH)
    survivors = [p for p in IDS if p not in net.dead]
    assert len(survivors) == 3
    assert all(net.runners[p].recovery is None for p in survivors)
    orphaned = net.runners[survivors[0]].round.orphans.parts
    assert orphaned, "the killed reducer left parts open"
    # somewhere the survivors still hold their own values, so they differ there
    assert not torch.equal(results[survivors[0]], results[survivors[1]])
    # one level less: the survivors recover and agree
    net, _, _, results = _in_virtual_time(200, 4, True, depth=MAX_RECOVERY_DEPTH - 1)
    survivors = [p for p in IDS if p not in net.dead]
    assert all(net.runners[p].recovery is not None for p in survivors)
    assert all(torch.allclose(results[p], results[survivors[0]], atol=1e-6) for p in survivors)
