"""RoundInbox on its own: where a round's frame goes, with stand-ins for the runner, the
matchmaking state and the core (no network)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

from peer.averaging.allreduce.inbox import RoundInbox
from peer.averaging.allreduce.recovery import RECOVERY_ID_BYTES
from peer.averaging.matchmaking.machine import MatchState
from peer.averaging.protocol import ABORT, PART
from peer.wire import Frame
from tests.conftest import scaled


class _Core:
    def __init__(self) -> None:
        self.sent: asyncio.Queue[tuple[str, Frame]] = asyncio.Queue()

    async def send(self, peer_id: str, frame: Frame) -> None:
        await self.sent.put((peer_id, frame))


@dataclass
class _Runner:
    started: bool = False
    early: list[tuple[str, Frame]] = field(default_factory=list)
    got: list[tuple[str, Frame]] = field(default_factory=list)

    def on_frame(self, sender: str, frame: Frame) -> None:
        self.got.append((sender, frame))


@dataclass
class _Group:
    group_id: bytes


@dataclass
class _Machine:
    state: MatchState = MatchState.LOOKING
    group: _Group | None = None
    leader: str | None = None

    def waiting_on(self) -> str | None:
        return self.leader


def _part(group_id: bytes, leader: str = "") -> Frame:
    return Frame(PART, {"p": "p", "g": group_id, "l": leader}, b"x" * 10)


async def test_frames_go_to_their_round_early_ones_first_and_none_after_it() -> None:
    inbox, core = RoundInbox("p", wire_bytes=1000), _Core()
    grouped = _Machine(MatchState.GROUPED, _Group(b"g"))
    inbox.route(core, grouped, "a", _part(b"g"))  # type: ignore[arg-type]
    runner = _Runner()
    inbox.open(b"g", runner)  # type: ignore[arg-type]
    assert [sender for sender, _ in runner.early] == ["a"]
    inbox.route(core, None, "b", _part(b"g"))  # type: ignore[arg-type]
    assert [sender for sender, _ in runner.early] == ["a", "b"]  # run() not begun yet
    runner.started = True
    inbox.route(core, None, "c", _part(b"g"))  # type: ignore[arg-type]
    assert [sender for sender, _ in runner.got] == ["c"]
    inbox.close(b"g")
    inbox.route(core, None, "d", _part(b"g"))  # type: ignore[arg-type]
    assert [sender for sender, _ in runner.got] == ["c"]
    assert core.sent.empty(), "a finished group's stragglers are dropped, not answered"


async def test_frames_from_the_leader_this_peer_waits_on_are_kept() -> None:
    inbox, core = RoundInbox("p", wire_bytes=1000), _Core()
    inbox.route(core, _Machine(leader="L"), "a", _part(b"h", leader="L"))  # type: ignore[arg-type]
    assert [sender for sender, _ in inbox.early.take(b"h")] == ["a"]
    assert core.sent.empty()


async def test_a_group_this_peer_is_not_in_is_told_so_once_per_sender() -> None:
    inbox, core = RoundInbox("p", wire_bytes=1000), _Core()
    for _ in range(3):
        inbox.route(core, _Machine(), "a", _part(b"x"))  # type: ignore[arg-type]
    inbox.route(core, None, "b", _part(b"x"))  # type: ignore[arg-type]
    inbox.route(core, None, "a", Frame(ABORT, {"p": "p", "g": b"x"}))  # type: ignore[arg-type]
    told: dict[str, Any] = {}
    for _ in range(2):
        peer_id, frame = await asyncio.wait_for(core.sent.get(), scaled(5))
        told[peer_id] = frame
    assert sorted(told) == ["a", "b"]
    assert all(f.type == ABORT and f.fields["g"] == b"x" for f in told.values())
    await asyncio.gather(*(asyncio.all_tasks() - {asyncio.current_task()}))  # every notice out
    assert core.sent.empty(), "each sender is told once; an abort is never answered"


async def test_a_recovery_of_a_round_goes_to_that_round_and_of_one_over_is_refused() -> None:
    # a recovery's group id is its round's followed by a digest (butterfly_recovery): the
    # round's runner sorts it out; once the round ended here, its sender hears "not a member"
    inbox, core = RoundInbox("p", wire_bytes=1000), _Core()
    round_id = b"r" * 16
    recovery = round_id + b"d" * RECOVERY_ID_BYTES
    runner = _Runner(started=True)
    inbox.open(round_id, runner)  # type: ignore[arg-type]
    inbox.route(core, None, "a", _part(recovery))  # type: ignore[arg-type]
    inbox.route(core, None, "a", _part(recovery + b"e" * RECOVERY_ID_BYTES))  # type: ignore[arg-type]
    assert [frame.fields["g"] for _, frame in runner.got] == [
        recovery,
        recovery + b"e" * RECOVERY_ID_BYTES,
    ]
    inbox.close(round_id)
    inbox.route(core, None, "b", _part(recovery))  # type: ignore[arg-type]
    peer_id, frame = await asyncio.wait_for(core.sent.get(), scaled(5))
    assert (peer_id, frame.type, frame.fields["g"]) == ("b", ABORT, recovery)
    assert len(runner.got) == 2
