"""The butterfly round's state machine (:mod:`peer.averaging.allreduce.round`), without I/O.

Scenarios first, then many machines on a simulated network where Hypothesis picks every
step: which member sends its next frame, which frame arrives, when the transport takes a
frame, when time jumps, which member is killed, which link breaks, and when a hostile
member's parts come out mangled. Whatever the order, every honest member that stays ends
its round, with, part by part, either its own values or the exact weighted mean of some of
the members' values — never anything else — and all members that took a reducer's average
of a part took the same one. Without faults, every member ends with the mean of all.
"""

from __future__ import annotations

import collections
import itertools
import math
import os
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from peer.averaging.allreduce.partition import FlatLayout
from peer.averaging.allreduce.round import (
    AllreduceConfig,
    ButterflyRound,
    Command,
    Done,
    Idle,
    MemberInfo,
    Send,
    Tell,
    Wake,
)
from peer.averaging.allreduce.send import RoundSending
from peer.averaging.exceptions import BadContribution
from peer.averaging.matchmaking.machine import GroupInfo
from peer.averaging.protocol import ABORT, AVERAGE, PART
from peer.compression import NoCompression
from peer.wire import Frame

PART_BYTES = 64  # 16 float32 values a part: several parts per span
# interleavings tried (about 100 a second); a longer run:
#   SWARMGRAD_ROUND_EXAMPLES=100000 .venv/bin/python -m pytest tests/peer/averaging/test_butterfly.py
EXAMPLES = int(os.environ.get("SWARMGRAD_ROUND_EXAMPLES", "1000"))
CONFIG = AllreduceConfig(part_size_bytes=PART_BYTES, sender_timeout=1.0, reducer_timeout=2.0)


def _machines(
    local: dict[str, torch.Tensor],
    *,
    weights: dict[str, float] | None = None,
    no_span: frozenset[str] = frozenset(),
    in_place: bool = True,
    round_cls: type[ButterflyRound] = ButterflyRound,
) -> dict[str, ButterflyRound]:
    ids = list(local)
    n = len(ids)
    weights = weights or dict.fromkeys(ids, 1.0)
    group = GroupInfo(b"g" * 8, "key", ids[0], tuple(ids), (b"",) * n, (False,) * n)
    members = [
        MemberInfo(p, False, 0.0 if p in no_span else 1.0, False, weight=weights[p]) for p in ids
    ]
    return {
        p: round_cls(
            p,
            "test",
            group,
            members,
            FlatLayout.from_tensors([local[p]]),
            local[p].clone(),
            weight=weights[p],
            compression=NoCompression(),
            roles=None,
            config=CONFIG,
            in_place=in_place,
        )
        for p in ids
    }


def _copy(frame: Frame) -> Frame:
    """The frame as the transport delivers it: its bytes as they were when sent."""
    payload = bytes(memoryview(frame.payload).cast("B")) if frame.payload else b""
    return Frame(frame.type, dict(frame.fields), payload)


def _result(machine: ButterflyRound, local: torch.Tensor) -> torch.Tensor:
    machine.finish()
    return machine.flat if machine.in_place else local + machine.flat


# ------------------------------------------------------------------ scenarios


def _exchange_all(machines: dict[str, ButterflyRound]) -> dict[str, list[Command]]:
    """Start every machine, then move frames until nothing is left to send; what each
    machine said."""
    said: dict[str, list[Command]] = collections.defaultdict(list)
    for p, m in machines.items():
        said[p] += m.start(0.0)
    moved = True
    while moved:
        moved = False
        for p, m in machines.items():
            for q in machines:
                if q == p or q in m.failed:
                    continue
                out = m.next_send(q)
                if isinstance(out, Send):
                    moved = True
                    said[q] += machines[q].on_frame(0.0, p, _copy(out.frame))
                    said[p] += m.sent(0.0, out)
        for p in machines:
            for command in said[p]:
                if isinstance(command, Tell):
                    said[command.peer_id] += machines[command.peer_id].on_frame(
                        0.0, p, command.frame
                    )
            said[p] = [c for c in said[p] if not isinstance(c, Tell)]
    return said


def test_three_members_end_on_the_mean_and_say_done_once() -> None:
    local = {f"p{i}": torch.arange(100, dtype=torch.float32) * i for i in range(3)}
    machines = _machines(local)
    said = _exchange_all(machines)
    mean = torch.stack(list(local.values())).mean(dim=0)
    for p, m in machines.items():
        assert [c for c in said[p] if isinstance(c, Done)] == [Done()]
        assert m.done and m.error is None
        assert torch.equal(_result(m, local[p]), mean)
        assert all(m.next_send(q) is Idle.CLOSED for q in machines if q != p)


def test_consecutive_parts_ready_together_travel_as_one_frame() -> None:
    local = {p: torch.ones(200) for p in ("a", "b")}
    machines = _machines(local)
    a = machines["a"]
    a.start(0.0)
    send = a.next_send("b")
    assert isinstance(send, Send) and send.kind == "part"
    assert send.count == len(a.partition.parts_of(1)) > 1
    assert send.frame.fields["k"] == send.count
    assert a.next_send("b") is Idle.WAIT  # b's averages are not in yet


def test_a_member_whose_own_span_holds_nan_leaves_before_sending() -> None:
    local = {p: torch.zeros(64) for p in ("a", "b")}
    local["a"][0] = math.nan
    machines = _machines(local)
    commands = machines["a"].start(0.0)
    done = [c for c in commands if isinstance(c, Done)]
    assert len(done) == 1 and isinstance(done[0].error, BadContribution)
    assert machines["a"].next_send("b") is Idle.CLOSED


def test_a_mangled_part_excludes_its_sender_and_tells_it() -> None:
    local = {p: torch.full((64,), float(i)) for i, p in enumerate(("a", "b", "c"))}
    machines = _machines(local)
    for m in machines.values():
        m.start(0.0)
    send = machines["c"].next_send("a")
    assert isinstance(send, Send) and send.kind == "part"
    bad = Frame(PART, send.frame.fields, bytes(memoryview(send.frame.payload))[:-4])
    commands = machines["a"].on_frame(0.0, "c", bad)
    assert Tell("c", machines["a"].abort_frame("excluded")) in commands
    assert "c" in machines["a"].failed


def test_a_silent_sender_is_excluded_at_its_timeout_and_the_rest_averaged() -> None:
    local = {p: torch.full((64,), float(i)) for i, p in enumerate(("a", "b", "c"))}
    machines = _machines(local)
    a = machines["a"]
    for m in machines.values():
        m.start(0.0)
    # b sends everything to a; c never does
    while isinstance(send := machines["b"].next_send("a"), Send):
        a.on_frame(0.5, "b", _copy(send.frame))
        machines["b"].sent(0.5, send)
    assert a.tick(CONFIG.sender_timeout - 0.1) == []
    commands = a.tick(CONFIG.sender_timeout + 0.1)
    assert "c" in a.excluded_senders
    assert Wake("b") in commands  # averages of a's span for b, without c's values
    kinds = []
    while isinstance(send := a.next_send("b"), Send):  # its contributions first
        kinds.append(send.kind)
        a.sent(1.2, send)
    assert kinds[-1] == "avg" and "part" in kinds


def test_a_reducer_killed_after_averaging_for_one_member_is_named_by_the_other() -> None:
    # c dies after its average reached b but before it reached a, which had sent all it
    # had to send: only the watchdog tells a, and c's span keeps a's own values there
    # while b has the mean. The results differ, and the member holding the odd one says so
    local = {p: torch.full((64,), float(i)) for i, p in enumerate(("a", "b", "c"))}
    machines = _machines(local)
    for m in machines.values():
        m.start(0.0)
    lost = 0
    moved = True
    while moved:
        moved = False
        for p, m in machines.items():
            for q in machines:
                if q != p and isinstance(send := m.next_send(q), Send):
                    moved = True
                    m.sent(0.1, send)
                    if (p, q, send.kind) == ("c", "a", "avg"):
                        lost += 1  # (c is dead by then)
                    else:
                        machines[q].on_frame(0.1, p, _copy(send.frame))
    a, b = machines["a"], machines["b"]
    assert lost and b.done and not a.done
    assert a.tick(0.1 + CONFIG.reducer_timeout + 0.1) and a.done
    results = {p: _result(machines[p], local[p]) for p in ("a", "b")}
    c_span = slice(*a.partition.spans[2])
    assert not torch.equal(results["a"][c_span], results["b"][c_span])
    assert a.failed == set() and a.left == {"c"}  # no send to c failed
    assert b.left == set()
    assert torch.equal(results["b"], torch.full((64,), 1.0))  # the mean


def test_an_abort_from_a_reducer_that_found_nan_makes_this_member_leave() -> None:
    local = {p: torch.zeros(64) for p in ("a", "b")}
    _, stop = _machines(local)["a"].partition.spans[1]
    local["a"][stop - 1] = math.nan  # in b's span: a cannot know before b says so
    machines = _machines(local)
    a = machines["a"]
    a.start(0.0)
    commands = a.on_frame(0.1, "b", Frame(ABORT, {"p": "test", "g": b"g" * 8, "why": "x"}))
    assert next(c for c in commands if isinstance(c, Done)).error is not None
    assert a.next_send("b") is Idle.CLOSED


# ------------------------------------------------------------- interleavings


@dataclass
class Net:
    """The members' transport, every step of which the test picks."""

    machines: dict[str, ButterflyRound]
    hostile: str | None
    now: float = 0.0
    started: set[str] = field(default_factory=set)
    early: dict[str, list[tuple[str, Frame]]] = field(
        default_factory=lambda: collections.defaultdict(list)
    )
    # in order per direction and channel: parts and averages on a lane, notices on the link
    queues: dict[tuple[str, str, bool], collections.deque[Frame]] = field(
        default_factory=lambda: collections.defaultdict(collections.deque)
    )
    inflight: dict[tuple[str, str], Send] = field(default_factory=dict)
    asleep: set[tuple[str, str]] = field(default_factory=set)
    closed: set[tuple[str, str]] = field(default_factory=set)  # sender tasks that ended
    dead: set[str] = field(default_factory=set)
    broken: set[frozenset[str]] = field(default_factory=set)
    gone: set[str] = field(default_factory=set)  # left the round: frames to it dropped
    outcome: dict[str, BadContribution | None] = field(default_factory=dict)
    mangle_next: bool = False

    def cut(self, p: str, q: str) -> bool:
        return p in self.dead or q in self.dead or frozenset((p, q)) in self.broken

    def execute(self, p: str, commands: list[Command]) -> None:
        for command in commands:
            if isinstance(command, Wake):
                assert command.peer_id in self.machines and command.peer_id != p
                self.asleep.discard((p, command.peer_id))
            elif isinstance(command, Tell):
                if not self.cut(p, command.peer_id):
                    self.queues[p, command.peer_id, False].append(command.frame)
            else:
                assert p not in self.outcome, f"{p} said Done twice"
                self.outcome[p] = command.error

    def left(self, p: str) -> bool:
        """``p`` found its own values bad: its caller stops the round and tells the others
        (until it does, frames still reach the machine and its senders still ask it)."""
        return self.outcome.get(p) is not None

    # the actions, each enabled or not

    def actions(self) -> list[tuple[Any, ...]]:
        out: list[tuple[Any, ...]] = []
        for p in self.machines:
            if p in self.dead or p in self.gone:
                continue
            if p not in self.started:
                out.append(("start", p))
                continue
            if self.left(p):
                out.append(("leave", p))
            for q in self.machines:
                if q == p or (p, q) in self.closed:
                    continue
                if (p, q) in self.inflight:
                    out.append(("taken", p, q))
                elif (p, q) not in self.asleep:
                    # a frame usually takes the lane, but may take the link (while the
                    # lane is being opened) and overtake, or be overtaken by, the others
                    out.append(("emit", p, q, True))
                    out.append(("emit", p, q, False))
        for (p, q, lane), queue in self.queues.items():
            if queue:
                out.append(("deliver", p, q, lane))
        return out

    def do(self, action: tuple[Any, ...]) -> None:
        kind = action[0]
        if kind == "start":
            p = action[1]
            self.started.add(p)
            self.execute(p, self.machines[p].start(self.now, self.early.pop(p, [])))
        elif kind == "leave":
            p = action[1]
            self.gone.add(p)
            frame = self.machines[p].abort_frame("its own values are not finite")
            for q in self.machines[p].others_present:
                if not self.cut(p, q):
                    self.queues[p, q, False].append(frame)
        elif kind == "emit":
            self.emit(*action[1:])
        elif kind == "taken":
            p, q = action[1], action[2]
            send = self.inflight.pop((p, q))
            error = "the link broke" if self.cut(p, q) else None
            if error is not None:
                self.closed.add((p, q))
            self.execute(p, self.machines[p].sent(self.now, send, error))
        elif kind == "deliver":
            p, q, lane = action[1:]
            frame = self.queues[p, q, lane].popleft()
            if q in self.dead or q in self.gone:
                return
            if q not in self.started:
                self.early[q].append((p, frame))
                return
            left = self.left(q)
            commands = self.machines[q].on_frame(self.now, p, frame)
            assert not (left and commands), "a member that left still acts on frames"
            self.execute(q, commands)

    def emit(self, p: str, q: str, lane: bool = True) -> None:
        out = self.machines[p].next_send(q)
        assert out is Idle.CLOSED or not self.left(p), "a member that left still sends"
        if out is Idle.CLOSED:
            self.closed.add((p, q))
        elif out is Idle.WAIT:
            self.asleep.add((p, q))
        else:
            frame = _copy(out.frame)
            if p == self.hostile and frame.type == PART and self.mangle_next:
                frame = Frame(PART, frame.fields, frame.payload[:-4])  # one value short
                self.mangle_next = False
            self.inflight[p, q] = out
            if not self.cut(p, q):
                self.queues[p, q, lane and frame.type in (PART, AVERAGE)].append(frame)

    def tick(self, dt: float) -> None:
        self.now += dt
        for p, m in self.machines.items():
            if p in self.started and p not in self.dead | self.gone and not m.done:
                self.execute(p, m.tick(self.now))

    def kill(self, p: str, lost: int) -> None:
        """``p`` dies; of what it sent and is still under way, frames from the ``lost``-th
        on in each queue are lost (a stream cut short)."""
        self.dead.add(p)
        for (src, _, _), queue in self.queues.items():
            if src == p:
                while len(queue) > lost:
                    queue.pop()

    def cut_link(self, p: str, q: str) -> None:
        """The link between ``p`` and ``q`` breaks: what was under way on it is lost."""
        self.broken.add(frozenset((p, q)))
        for src, dst in ((p, q), (q, p)):
            for lane in (False, True):
                self.queues[src, dst, lane].clear()

    def drain(self) -> None:
        """Everything arrives, in order; time moves only when nothing else can."""
        for _ in range(100_000):
            moves = self.actions()
            if moves:
                for action in moves:
                    if action[0] == "emit" and not action[3]:
                        continue  # on the lane
                    if action[0] != "deliver" or self.queues[action[1:]]:
                        self.do(action)
                continue
            waiting = [
                p for p, m in self.machines.items() if p not in self.dead | self.gone and not m.done
            ]
            if not waiting:
                return
            assert self.now < 60, f"rounds that do not end: {waiting}"
            self.tick(0.25)
        raise AssertionError("the network never went quiet")


def _weighted_means(
    values: list[torch.Tensor], weights: list[float], including: list[int] | None = None
) -> list[torch.Tensor]:
    """The weighted means of every subset of ``values`` (that holds ``including``)."""
    means = []
    for k in range(1, len(values) + 1):
        for subset in itertools.combinations(range(len(values)), k):
            if including is not None and not set(including) <= set(subset):
                continue
            total = sum(weights[i] for i in subset)
            means.append(sum(values[i] * (weights[i] / total) for i in subset))
    return means


@st.composite
def _swarms(draw: st.DrawFn) -> dict[str, Any]:
    n = draw(st.integers(2, 5))
    ids = [f"p{i}" for i in range(n)]
    numel = draw(st.integers(1, 90))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
    local = {p: torch.randint(-8, 9, (numel,), generator=gen).float() for p in ids}
    weights = {p: float(draw(st.integers(1, 3))) for p in ids}
    nan = draw(st.none() | st.sampled_from(ids))
    if nan is not None:
        local[nan][draw(st.integers(0, numel - 1))] = math.nan
    hostile = draw(st.none() | st.sampled_from([p for p in ids if p != nan]))
    no_span = frozenset(draw(st.sets(st.sampled_from(ids), max_size=n - 1)))
    return dict(
        # one part per frame, two, or every part ready at once
        max_batch_bytes=draw(st.sampled_from([0, 2 * PART_BYTES, RoundSending.max_batch_bytes])),
        local=local,
        weights=weights,
        nan=nan,
        hostile=hostile,
        no_span=no_span,
        in_place=draw(st.booleans()),
    )


@settings(
    max_examples=EXAMPLES,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    derandomize=True,
)
@given(swarm=_swarms(), data=st.data())
def test_any_interleaving_ends_each_staying_member_on_its_own_values_or_an_exact_mean(
    swarm: dict[str, Any], data: st.DataObject
) -> None:
    local, weights = swarm["local"], swarm["weights"]
    ids = list(local)
    machines = _machines(
        local, weights=weights, no_span=swarm["no_span"], in_place=swarm["in_place"]
    )
    for m in machines.values():
        m.sending.max_batch_bytes = swarm["max_batch_bytes"]
    net = Net(machines, swarm["hostile"])
    faults = collections.Counter[str]()
    for _ in range(data.draw(st.integers(0, 150), label="steps")):
        choice = data.draw(st.integers(0, 19), label="kind")
        if choice == 0:
            net.tick(data.draw(st.sampled_from([0.3, 1.2, 2.5]), label="dt"))
            faults["time"] += 1
        elif choice == 1 and not faults["killed"]:
            victim = data.draw(st.sampled_from(ids), label="victim")
            if victim != swarm["nan"]:
                net.kill(victim, data.draw(st.integers(0, 3), label="lost"))
                faults["killed"] += 1
        elif choice == 2 and len(ids) > 2:
            pair = data.draw(st.sets(st.sampled_from(ids), min_size=2, max_size=2), label="cut")
            net.cut_link(*pair)
            faults["broken"] += 1
        elif choice == 3 and swarm["hostile"] is not None:
            net.mangle_next = True
            faults["mangled"] += 1
        else:
            actions = net.actions()
            if not actions:
                break
            net.do(data.draw(st.sampled_from(actions), label="action"))
    net.drain()

    bad, hostile = swarm["nan"], swarm["hostile"]
    honest = [p for p in ids if p not in net.dead and p != bad]
    for p in honest:
        assert p in net.outcome, f"{p} never ended its round"
        assert net.outcome[p] is None, (p, net.outcome[p])
    if bad is not None and not (faults["time"] or net.dead or net.broken or faults["mangled"]):
        # (a reducer that gave up on it, is gone, or that it dropped before the NaN's part
        # was checked cannot report it: the NaN then stays in the bad member's own values)
        assert net.outcome.get(bad) is not None, "a member holding NaN leaves its round"

    values = [local[p] for p in ids]
    w = [weights[p] for p in ids]
    partition = machines[ids[0]].partition
    results = {p: _result(machines[p], local[p]) for p in honest}
    # on a network that loses nothing and never keeps anyone waiting, an honest reducer's
    # averages hold the values of every member that did nothing wrong
    fair = not (faults["time"] or net.dead or net.broken)
    clean = [i for i, p in enumerate(ids) if p not in (bad, hostile)]
    for r, reducer in enumerate(ids):
        for part in partition.parts_of(r):
            slices = [part.view(v) for v in values]
            means = _weighted_means(slices, w)
            required = _weighted_means(slices, w, including=clean)
            taken: list[torch.Tensor] = []
            for p, result in results.items():
                got, own = part.view(result), part.view(local[p])
                assert torch.isfinite(got).all(), (p, r, got)
                if reducer in machines[p].offenders:  # its whole span keeps the own values
                    assert torch.equal(got, own), (p, reducer)
                    continue
                if fair and reducer not in (bad, hostile) and p != hostile:
                    assert any(torch.allclose(got, m, atol=1e-5, rtol=0) for m in required)
                if torch.allclose(got, own, atol=1e-5, rtol=0):
                    continue
                assert any(torch.allclose(got, m, atol=1e-5, rtol=0) for m in means), (p, r)
                taken.append(got)
            # every member that took this part's average took the same one
            for got in taken[1:]:
                assert torch.allclose(got, taken[0], atol=1e-5, rtol=0), (r, part)
    # members that do not name anyone as having left the round end on the same result
    # (DiLoCo applies a round only then: tests/peer/optim/test_diloco_swarm.py)
    whole = [p for p in honest if p != hostile and not machines[p].left]
    for p in whole[1:]:
        assert torch.allclose(results[p], results[whole[0]], atol=1e-5, rtol=0), (p, whole[0])
    if fair and not (bad or hostile):
        total = sum(w)
        mean = sum(v * (wi / total) for v, wi in zip(values, w, strict=True))
        for p, result in results.items():
            assert torch.allclose(result, mean, atol=1e-5, rtol=0), p


@pytest.mark.parametrize("in_place", [True, False])
def test_a_hostile_members_mangled_parts_never_reach_an_average(in_place: bool) -> None:
    """Every part from ``c`` (which reduces nothing) arrives one value short: both honest
    members exclude it (and say so) and end on the mean of the two of them."""
    local = {p: torch.full((96,), float(i)) for i, p in enumerate(("a", "b", "c"))}
    machines = _machines(local, in_place=in_place, no_span=frozenset("c"))
    net = Net(machines, hostile="c", mangle_next=True)
    for p in machines:
        net.do(("start", p))
    original = net.emit

    def emit(p: str, q: str, lane: bool = True) -> None:
        net.mangle_next = True
        original(p, q, lane)

    net.emit = emit  # type: ignore[method-assign]
    net.drain()
    for p in ("a", "b"):
        assert net.outcome[p] is None and "c" in machines[p].failed
        assert torch.allclose(_result(machines[p], local[p]), torch.full((96,), 0.5))


@pytest.mark.parametrize("others_last_part", ["before", "after"])
def test_averages_from_a_reducer_whose_own_parts_turn_out_bad_are_never_written(
    others_last_part: str,
) -> None:
    """In place, ``c``'s averages reach ``a`` (over the link) before ``c``'s last part to
    ``a`` (on the lane), which holds a NaN: ``a`` holds those averages until ``c``'s parts
    are all in and checked — found bad, ``c``'s span keeps ``a``'s own values. The NaN is
    found when its part completes or, if ``b``'s share of that part is still missing, when
    ``c``'s last part arrives."""
    local = {p: torch.full((96,), float(i)) for i, p in enumerate(("a", "b", "c"))}
    _, stop = _machines(local)["a"].partition.spans[0]
    local["c"][stop - 1] = math.nan  # c's last value for a's span
    machines = _machines(local)
    net = Net(machines, hostile=None)
    for p, m in machines.items():
        m.sending.max_batch_bytes = 0  # one part per frame
        net.do(("start", p))
    a_parts = len(machines["a"].partition.parts_of(0))

    def send(p: str, q: str, frames: int, lane: bool = True, deliver: bool = True) -> None:
        for _ in range(frames):
            net.do(("emit", p, q, lane))
            assert (p, q) in net.inflight, (p, q, frames)
            net.do(("taken", p, q))
            if deliver:
                net.do(("deliver", p, q, lane and (p, q, True) in net.queues))

    send("c", "a", a_parts - 1)
    send("b", "a", a_parts if others_last_part == "before" else a_parts - 1)
    for p in ("a", "b"):
        send(p, "c", len(machines["c"].partition.parts_of(2)))
    send("c", "a", 1, deliver=False)  # the NaN part, still on its way
    send("c", "a", len(machines["c"].partition.parts_of(2)), lane=False)  # its averages
    net.do(("deliver", "c", "a", True))  # then the NaN part
    net.drain()
    a = machines["a"]
    assert "c" in a.offenders and net.outcome["a"] is None
    start, stop = a.partition.spans[2]
    assert torch.equal(_result(a, local["a"])[start:stop], local["a"][start:stop])
