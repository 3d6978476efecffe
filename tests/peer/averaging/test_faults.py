"""Faults during all-reduce: peers that die and peers that send bad parts.

Peers that die run each in its own process (the SIGKILL cases need real processes); bad
parts are injected in-process over WebSocket on loopback.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import math
import socket
import time
from pathlib import Path
from typing import Any

import pytest
import torch

import peer.transport.bulk as bulk_module
import peer.transport.lane_socket as lane_socket
from peer.averaging.allreduce.runner import AllreduceRunner
from peer.averaging.exceptions import NonFiniteTensors
from swarmlab.averager_doubles import averager_with
from swarmlab.averager_process import AveragerProcess, faulty_runner
from tests.conftest import scaled
from tests.peer.averaging.conftest import step_all, wait_for

N = 5
NUMEL = 750_000  # 3 MB of fp32 per peer
# 40 MB per peer: what each survivor owes a frozen peer (its 8 MB span, then 8 MB of
# averages) is more than the socket buffers between them hold, so sending to it blocks
LARGE_NUMEL = 10_000_000


def _tensors(i: int, numel: int = NUMEL) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(100 + i)
    return [torch.randn(numel, generator=g), torch.randn(7, generator=g)]


@pytest.mark.slow
@pytest.mark.parametrize(
    "fault, numel",
    [
        ("kill_after_first_part", NUMEL),
        ("stall_after_first_part", NUMEL),
        ("freeze_after_first_part", NUMEL),
        # the survivors' sends to it block: they give up after sender_timeout, not at the
        # end of the round's allreduce_timeout
        ("freeze_after_first_part", LARGE_NUMEL),
        ("kill_while_reducing", NUMEL),
    ],
    ids=["kill", "stall", "freeze", "freeze-send-blocks", "kill-while-reducing"],
)
def test_survivors_finish_with_the_mean_over_survivors(
    tmp_path: Path, fault: str, numel: int
) -> None:
    config = dict(
        prefix="faults",
        min_matchmaking_time=2.0,
        request_timeout=2.0,
        part_size_bytes=64 * 1024,
        sender_timeout=2.0,
        reducer_timeout=4.0,
        allreduce_timeout=30.0,
        target_group_size=N,
    )
    local = [_tensors(i, numel) for i in range(N)]
    for i, t in enumerate(local):
        torch.save(t, tmp_path / f"in{i}.pt")
    faulty = N - 1
    procs: list[AveragerProcess] = []
    try:
        first = AveragerProcess(str(tmp_path / "in0.pt"), config=config)
        procs.append(first)
        for i in range(1, N):
            procs.append(
                AveragerProcess(
                    str(tmp_path / f"in{i}.pt"),
                    initial_peers=first.addresses,
                    config=config,
                    fault=fault if i == faulty else None,
                )
            )
        assert wait_for(lambda: all(p.call(cmd="members")["members"] == N for p in procs), 20)
        for i, p in enumerate(procs):
            # one attempt: a round that only ends at allreduce_timeout fails the test
            kw = {"timeout": 60, "allow_retries": False}
            p.send(cmd="step", kw=kw, out=str(tmp_path / f"out{i}.pt"))
        replies = {}
        for i, p in enumerate(procs):
            if i != faulty:
                replies[i] = p.receive()
        if fault.startswith("kill"):
            procs[faulty].proc.wait(timeout=scaled(60))
            assert procs[faulty].proc.returncode == -9  # it really was SIGKILLed mid-round
        if fault.startswith("freeze"):  # it really is stopped, its connections still open
            stat = Path(f"/proc/{procs[faulty].proc.pid}/stat").read_text()
            assert stat.rsplit(")", 1)[1].split()[0] == "T", stat
        survivors = [i for i in range(N) if i != faulty]
        mean_survivors = [sum(local[i][j] for i in survivors) / len(survivors) for j in range(2)]
        mean_all = [sum(local[i][j] for i in range(N)) / N for j in range(2)]
        left_out = 0  # elements of survivors' results that the faulty peer did not reach
        results = {}
        for i in survivors:
            assert replies[i]["ok"], replies[i]
            assert len(replies[i]["gathered"]) == N
            result = results[i] = torch.load(tmp_path / f"out{i}.pt", weights_only=True)
            averaged = 0
            for j in range(2):
                r = result[j]
                assert torch.isfinite(r).all()
                near_survivors = torch.isclose(r, mean_survivors[j], atol=1e-5, rtol=0)
                near_all = torch.isclose(r, mean_all[j], atol=1e-5, rtol=0)
                near_local = torch.isclose(r, local[i][j], atol=1e-5, rtol=0)
                # every element is one of the allowed outcomes: those, or (survivors whose
                # views of the fault differ finish the faulty reducer's parts apart) the
                # exact mean of some of the survivors
                allowed = near_survivors | near_all | near_local
                for k in range(2, len(survivors)):
                    for subset in itertools.combinations(survivors, k):
                        mean = sum(local[m][j] for m in subset) / k
                        allowed |= torch.isclose(r, mean, atol=1e-5, rtol=0)
                assert allowed.all()
                averaged += int((near_survivors | near_all).sum())
                left_out += int((~near_all).sum())
            # ... and only the faulty reducer's span (about 1/N) keeps local values
            assert averaged >= 0.6 * (numel + 7)
        assert left_out > 0, "the fault was not injected: every result is the mean over all"
        if fault == "kill_while_reducing":
            # every survivor saw the reducer die before any of its averages came: they
            # finished its span together and hold the same values everywhere, none their own
            first = results[survivors[0]]
            for i in survivors[1:]:
                for j in range(2):
                    assert torch.allclose(results[i][j], first[j], atol=1e-6, rtol=0), i
            for j in range(2):
                near_survivors = torch.isclose(first[j], mean_survivors[j], atol=1e-5, rtol=0)
                near_all = torch.isclose(first[j], mean_all[j], atol=1e-5, rtol=0)
                assert (near_survivors | near_all).all()
    finally:
        for p in procs:
            p.kill()


def _round_tasks(node) -> list[str]:
    """Tasks started by the averaging package, except the state-declaration loop."""

    async def names() -> list[str]:
        out = []
        for task in asyncio.all_tasks():
            code = getattr(task.get_coro(), "cr_code", None)
            if (
                code is not None
                and "averaging" in code.co_filename
                and code.co_name not in ("_declare_state_loop", "names")
            ):
                out.append(code.co_name)
        return out

    return node.run_coroutine(names())


def test_a_slow_link_is_not_taken_for_a_dead_peer(make_swarm, monkeypatch) -> None:
    """Timeouts are for silence, not for slowness: on links so slow that every frame takes
    longer than sender_timeout and reducer_timeout, bytes keep moving, and the round ends
    with the exact mean and nobody excluded."""
    small = 64 << 10
    tune = bulk_module._tune

    def small_buffers(sock: socket.socket) -> None:
        tune(sock)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, small)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, small)

    read = lane_socket.SocketLane._on_readable

    def read_then_pause(lane) -> None:  # about 2 MB/s
        read(lane)
        if lane._reading:
            lane._pause()
            lane.owner.loop.call_later(0.05, lane._resume)

    monkeypatch.setattr(bulk_module, "_tune", small_buffers)
    monkeypatch.setattr(lane_socket, "_READ_BUDGET", small)
    monkeypatch.setattr(lane_socket.SocketLane, "_on_readable", read_then_pause)
    swarm = make_swarm(2)
    # 2 MB spans: each frame of contributions or averages takes about a second
    tensors = [[torch.randn(1_000_000)] for _ in range(2)]
    expected = [(tensors[0][0] + tensors[1][0]) / 2]
    averagers = swarm.add_averagers(tensors, sender_timeout=0.3, reducer_timeout=0.6)
    started = time.monotonic()
    results = step_all(averagers, [{"allow_retries": False}] * 2)
    assert all(isinstance(r, dict) for r in results), results
    for t in tensors:
        assert torch.allclose(t[0], expected[0], atol=1e-6, rtol=0)
    assert time.monotonic() - started > 4 * 0.6, "the links were not slow: no test"


@pytest.mark.parametrize("fault", ["nan", "wrong_length", "oversized", "bad_range"])
def test_bad_parts_exclude_the_sender(make_swarm, caplog, fault: str) -> None:
    """A sender of NaN, wrong-length or oversized parts (or of a batch of parts past
    the end of the span) is excluded and logged once
    by each honest reducer; honest peers get exactly the mean over honest peers."""
    swarm = make_swarm(4)
    tensors = [[torch.randn(5000), torch.randn(3, 3)] for _ in range(4)]
    honest = [0, 1, 2]
    expected = [sum(tensors[i][j] for i in honest) / 3 for j in range(2)]
    averagers = swarm.add_averagers(
        tensors,
        part_size_bytes=4096,
        sender_timeout=scaled(5.0),
        # the bad peer reduces nothing
        per_peer=[
            {},
            {},
            {},
            {"bandwidth": 0.0, "averager_class": averager_with(runner=faulty_runner(fault))},
        ],
    )
    with caplog.at_level(logging.WARNING, logger="peer.averaging"):
        results = step_all(averagers)
    # no task of the round outlives it (a last abort notice may still be on its way)
    assert wait_for(lambda: not any(_round_tasks(n) for n in swarm.nodes), 5), [
        _round_tasks(n) for n in swarm.nodes
    ]
    for i in honest:
        assert isinstance(results[i], dict), results[i]
        for got, want in zip(tensors[i], expected, strict=True):
            assert torch.allclose(got, want, atol=1e-6, rtol=0)
    bad_id = averagers[3].peer_id
    logged = [
        r for r in caplog.records if bad_id in r.getMessage() and "excluding" in r.getMessage()
    ]
    assert len(logged) == len(honest)  # once per honest reducer, not once per part


def test_bad_reducer_span_keeps_local_values(make_swarm) -> None:
    """A bad sender that also reduces is excluded in both roles: its span keeps the local
    values at honest peers, everything else is the honest mean."""
    swarm = make_swarm(3)
    tensors = [[torch.randn(3000)] for _ in range(3)]
    local = [t[0].clone() for t in tensors]
    expected = (local[0] + local[1]) / 2
    bad = averager_with(runner=faulty_runner("nan"))
    averagers = swarm.add_averagers(
        tensors, part_size_bytes=2048, per_peer=[{}, {}, {"averager_class": bad}]
    )
    results = step_all(averagers)
    for i in (0, 1):
        assert isinstance(results[i], dict)
        got = tensors[i][0]
        mean_ok = torch.isclose(got, expected, atol=1e-6, rtol=0)
        local_ok = torch.isclose(got, local[i], atol=1e-6, rtol=0)
        assert (mean_ok | local_ok).all() and torch.isfinite(got).all()
        assert mean_ok.float().mean() > 0.5


class _NanOutsideOwnSpan(AllreduceRunner):
    """Puts a NaN into this peer's values of the next member's span as the round starts
    (where it is found is then known: not in this peer's own span)."""

    async def run(self) -> None:
        machine = self.round
        _, stop = machine.partition.spans[(machine.index + 1) % len(machine.members)]
        machine.flat[stop - 1] = math.nan
        await super().run()


@pytest.mark.parametrize("where", ["everywhere", "no span", "outside its span"])
def test_a_peer_with_non_finite_tensors_fails_its_step_and_the_others_go_on(
    make_swarm, where: str
) -> None:
    """A peer whose own values hold NaN leaves the round (``NonFiniteTensors``, no retry);
    the others average without it (its span, if it has one, keeps their local values). Its
    own span (all its values if it reduces nothing, ``bandwidth=0``) is checked before the
    round: the tensors are then unchanged. A NaN outside its span is found by that span's
    reducer, which excludes it and says so; the peer then checks and fails its step too."""
    swarm = make_swarm(3)
    tensors = [[torch.randn(3000)] for _ in range(3)]
    if where != "outside its span":
        tensors[2][0][::7] = math.nan
    local = [t[0].clone() for t in tensors]
    third: dict[str, Any] = {
        "no span": {"bandwidth": 0.0},
        "outside its span": {"averager_class": averager_with(runner=_NanOutsideOwnSpan)},
    }.get(where, {})
    averagers = swarm.add_averagers(
        tensors, part_size_bytes=2048, sender_timeout=scaled(5.0), per_peer=[{}, {}, third]
    )
    results = step_all(averagers)
    assert isinstance(results[2], NonFiniteTensors), results[2]
    if where == "outside its span":
        assert int(tensors[2][0].isnan().sum()) == 1  # still there: nothing averaged it away
    else:
        assert torch.equal(tensors[2][0].isnan(), local[2].isnan())  # unchanged
        assert torch.equal(tensors[2][0].nan_to_num(), local[2].nan_to_num())
    expected = (local[0] + local[1]) / 2
    for i in (0, 1):
        assert isinstance(results[i], dict), results[i]
        got = tensors[i][0]
        mean_ok = torch.isclose(got, expected, atol=1e-6, rtol=0)
        if where == "outside its span":
            # its finite values count where no reducer found fault with them before it left
            mean_ok |= torch.isclose(got, sum(local) / 3, atol=1e-6, rtol=0)
        local_ok = torch.isclose(got, local[i], atol=1e-6, rtol=0)
        assert (mean_ok | local_ok).all() and torch.isfinite(got).all()
        assert mean_ok.float().mean() > 0.5 if where != "no span" else mean_ok.all()
