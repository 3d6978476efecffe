"""Where a round's frame goes on one averager: ``avg.part``, ``avg.average`` and
``avg.abort``, which a link reader hands over inline.

* to the runner of its group, if that round runs here (kept for it until ``run()`` begins);
* dropped, if its group finished here (stragglers of a round this peer left or ended);
* kept in a bounded waiting room (:class:`~peer.averaging.allreduce.early.EarlyFrames`) if its group
  is the one this peer is joining — grouped, or waiting on the leader that sent it — since a
  member that learns of the group first may send at once;
* otherwise answered with ``avg.abort`` ("not a member": a group that named this peer after
  it left goes on without it), once per group and sender.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any

from peer.averaging.allreduce.early import EarlyFrames
from peer.averaging.allreduce.recovery import RECOVERY_ID_BYTES
from peer.averaging.allreduce.runner import AllreduceRunner
from peer.averaging.matchmaking.machine import Matchmaker
from peer.averaging.matchmaking.messages import MatchState
from peer.averaging.protocol import ABORT
from peer.averaging.seam import NodeCore
from peer.exceptions import SwarmgradError
from peer.wire import Frame

logger = logging.getLogger("peer.averaging")

__all__ = ["RoundInbox"]

_FINISHED_KEPT = 64  # groups remembered as finished
_NAMES_KEPT = 4096  # senders warned about / groups told to go on, before forgetting


class RoundInbox:
    """One averager's round frames, by group id. ``wire_bytes`` is what this peer's tensors
    take on the wire: an honest sender sends at most the parts of this peer's span ahead of
    its group (at most every tensor), which bounds the waiting room."""

    def __init__(self, prefix: str, wire_bytes: int) -> None:
        self.prefix = prefix
        self.early = EarlyFrames(
            total_limit=4 * wire_bytes + (1 << 20), sender_limit=wire_bytes + (64 << 10)
        )
        self._runners: dict[bytes, AllreduceRunner] = {}
        self._finished: dict[bytes, None] = {}
        self._early_refused: set[str] = set()  # senders warned about, once each
        self._told_abort: set[tuple[bytes, str]] = set()
        self._background: set[asyncio.Task[Any]] = set()

    def open(self, group_id: bytes, runner: AllreduceRunner) -> None:
        """``runner`` runs the round of ``group_id`` here: it takes the group's frames,
        those that came early first."""
        self._runners[group_id] = runner
        runner.early.extend(self.early.take(group_id))

    def close(self, group_id: bytes) -> None:
        """The round of ``group_id`` ended here (or never began): its frames are dropped."""
        self._runners.pop(group_id, None)
        self._finished[group_id] = None
        while len(self._finished) > _FINISHED_KEPT:
            del self._finished[next(iter(self._finished))]

    def route(self, core: NodeCore, machine: Matchmaker | None, sender: str, frame: Frame) -> None:
        """Deliver, keep, drop or answer ``frame`` from ``sender`` (see the module
        docstring); ``machine`` is this peer's matchmaking, if it looks for a group."""
        group_id = frame.fields["g"]
        runner = self._runners.get(group_id)
        parent = group_id
        while runner is None and len(parent) > RECOVERY_ID_BYTES:
            # a recovery of a round here (butterfly_recovery): that round's runner sorts it
            # out (a recovery of a round over here is answered below: not a member)
            parent = parent[:-RECOVERY_ID_BYTES]
            runner = self._runners.get(parent)
        if runner is not None:
            if runner.started:
                runner.on_frame(sender, frame)
            else:
                runner.early.append((sender, frame))
            return
        if group_id in self._finished:
            return
        expected = machine is not None and (
            (
                machine.state is MatchState.GROUPED
                and machine.group is not None
                and machine.group.group_id == group_id
            )
            or (frame.type != ABORT and machine.waiting_on() == frame.fields.get("l"))
        )
        if expected:
            if not self.early.add(group_id, sender, frame) and sender not in self._early_refused:
                if len(self._early_refused) >= _NAMES_KEPT:
                    self._early_refused.clear()
                self._early_refused.add(sender)
                logger.warning(
                    "%s: dropped frames peer %s sent ahead of its group: over its share of "
                    "the %d bytes kept for them",
                    self.prefix,
                    sender,
                    self.early.sender_limit,
                )
            return
        if frame.type != ABORT and (group_id, sender) not in self._told_abort:
            # a group that named us after we left (see matchmaking): tell it to go on
            self._told_abort.add((group_id, sender))
            if len(self._told_abort) > _NAMES_KEPT:
                self._told_abort.clear()
            abort = Frame(ABORT, {"p": self.prefix, "g": group_id, "why": "not a member"})
            task = asyncio.get_running_loop().create_task(_send_quietly(core, sender, abort))
            self._background.add(task)
            task.add_done_callback(self._background.discard)


async def _send_quietly(core: NodeCore, peer_id: str, frame: Frame) -> None:
    with contextlib.suppress(SwarmgradError, TimeoutError):
        async with asyncio.timeout(2.0):
            await core.send(peer_id, frame)
