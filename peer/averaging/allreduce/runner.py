"""One butterfly all-reduce round over the node's links: the driver of
:class:`~peer.averaging.allreduce.round.ButterflyRound`.

The round's rules live in the machine (:mod:`peer.averaging.allreduce.round`); this module gives
it time and I/O: link readers hand frames to :meth:`AllreduceRunner.on_frame` inline; one
sender task per member pulls that member's next frame and sends it (on a bulk lane if the
node has them); a watchdog ticks the machine with the lanes' signs of life; notices to
excluded members go out in the background, best effort. The caller bounds the round with
``allreduce_timeout`` and tells the members when it gives up (:meth:`AllreduceRunner.abort`).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
from collections.abc import Callable, Sequence
from typing import Any, ClassVar

import torch

from peer.averaging.allreduce.partition import FlatLayout
from peer.averaging.allreduce.recovery import is_recovery_of, plan_recovery
from peer.averaging.allreduce.round import (
    AllreduceConfig,
    ButterflyRound,
    Command,
    Done,
    Idle,
    MemberInfo,
    Tell,
    Wake,
)
from peer.averaging.exceptions import BadContribution
from peer.averaging.matchmaking.messages import GroupInfo
from peer.averaging.protocol import ABORT
from peer.averaging.seam import Link, NodeCore
from peer.compression import Compression, NoCompression, TensorRole
from peer.exceptions import SwarmgradError, TransportError
from peer.wire import Frame

__all__ = ["AllreduceConfig", "AllreduceRunner", "MemberInfo", "RoundFactory", "RunnerFactory"]

#: builds a round's machine; takes :class:`~peer.averaging.allreduce.round.ButterflyRound`'s
#: arguments
RoundFactory = Callable[..., ButterflyRound]


#: recovery frames kept for a recovery not begun yet here (one per part of a span, a few)
_RECOVERY_EARLY_FRAMES = 4096

#: recoveries of recoveries at most (the heir of a dead reducer's parts died too, and the
#: next heir); past them a member keeps its own values there rather than wait, since each
#: level waits longer than the one before
MAX_RECOVERY_DEPTH = 2

logger = logging.getLogger("peer.averaging.butterfly")


def _never(peer_id: str) -> float:
    return 0.0


class AllreduceRunner:
    """Run one round: ``await run()``; afterwards ``flat`` holds the round's result (see
    :mod:`peer.averaging.allreduce.round` for the two modes). ``run()`` raises
    :class:`~peer.averaging.exceptions.BadContribution` if this peer's own values are bad.

    What a subclass overrides (tests do, to see the other members cope): :attr:`round_class`
    builds the round's machine (:class:`~peer.averaging.allreduce.round.ButterflyRound`, given
    its arguments; a subclass that misbehaves). Faults in sending are injected through
    ``core`` (a wrapper around the node's).

    The round's rules — who reduces what, batching, in-place results, every fault decision —
    live in the machine (:mod:`peer.averaging.allreduce.round`); this class gives it time and I/O:

    * the link readers hand frames to :meth:`AllreduceRunner.on_frame` inline (decoding and
      in-place arithmetic happen there, in the reader's turn of the event loop);
    * one sender task per member pulls that member's next frame from the machine and sends it
      (on a bulk lane if the node has them, else on the link), waiting for a wake-up when there
      is nothing yet — so sending, reducing and returning overlap, and one frame per member is
      under way at a time;
    * a watchdog ticks the machine with the lanes' signs of life (bytes still arriving or
      leaving count, so a slow link is not a dead one);
    * notices to excluded members go out in the background, best effort.

    The caller bounds the whole round with ``allreduce_timeout`` and tells the members when it
    gives up (:meth:`AllreduceRunner.abort`).
    """

    round_class: ClassVar[RoundFactory] = ButterflyRound

    def __init__(
        self,
        core: NodeCore,
        prefix: str,
        group: GroupInfo,
        members: Sequence[MemberInfo],
        layout: FlatLayout,
        flat: torch.Tensor,
        *,
        weight: float,
        compression: Compression,
        roles: Sequence[TensorRole] | None,
        config: AllreduceConfig,
        scratch: Callable[[int, torch.dtype], torch.Tensor] | None = None,
        in_place: bool = False,
        alpha: float = 1.0,
        candidates: Sequence[MemberInfo] | None = None,
        depth: int = 0,
    ) -> None:
        self.core = core
        self.depth = depth  # recoveries above this round (0: a round of its own)
        # whom the heir of a dead reducer's parts is chosen from (butterfly_recovery)
        self._candidates = candidates
        self.round = type(self).round_class(
            core.peer_id,
            prefix,
            group,
            members,
            layout,
            flat,
            weight=weight,
            compression=compression,
            roles=roles,
            config=config,
            scratch=scratch,
            in_place=in_place,
            alpha=alpha,
        )
        self.config = config
        self.prefix = prefix
        # the survivors' round over the parts a dead reducer left open (butterfly_recovery)
        self.recovery: AllreduceRunner | None = None
        self._recovery_early: list[tuple[str, Frame]] = []
        self._recovery_early_bytes = 0
        # what the survivors may send before this one begins: contributions to the open
        # parts (to the heir) or their averages (from it), each at most the whole vector
        self._recovery_early_limit = 2 * flat.numel() * flat.element_size() + (64 << 10)
        self._over = False  # the round itself is over: its recovery (if any) is known
        self._told: set[tuple[bytes, str]] = set()  # recovery frames answered with an abort
        #: ``(start, stop) → members`` whose contributions this member's result holds there,
        #: for the slots of the flat vector the survivors finished (elsewhere: the round's
        #: :attr:`contributors`). As this member knows it: a sender that a reducer excluded
        #: for its silence is left out of that reducer's averages without the others hearing
        #: of it (the averages carry no list of their senders)
        self.included: dict[tuple[int, int], frozenset[str]] = {}
        self._loop = asyncio.get_running_loop()
        self._wakeups = {peer_id: asyncio.Event() for peer_id in self.round.others_present}
        self._done = asyncio.Event()
        self._background: set[asyncio.Task[Any]] = set()
        self.started = False
        self.early: list[tuple[str, Frame]] = []  # frames that arrived before run()

    @property
    def failed(self) -> set[str]:
        """Members excluded in both roles."""
        return self.round.failed

    @property
    def contributors(self) -> set[str]:
        """Members none of whose roles failed (for logging and tests)."""
        return self.round.contributors

    # ------------------------------------------------------------------ run

    async def run(self) -> None:
        loop = self._loop
        self.started = True
        machine = self.round
        early: list[tuple[str, Frame]] = []
        waiting, self.early = self.early, []
        for sender, frame in waiting:
            if frame.fields.get("g", machine.group.group_id) == machine.group.group_id:
                early.append((sender, frame))
            else:
                self.on_frame(sender, frame)  # a recovery's: kept for it
        senders: list[asyncio.Task[None]] = []
        watchdog: asyncio.Task[None] | None = None
        try:
            self._apply(machine.start(loop.time(), early))
            if machine.error is None:
                senders = [loop.create_task(self._sender(p)) for p in self._wakeups]
                watchdog = loop.create_task(self._watchdog())
                await self._done.wait()
            if machine.error is not None:
                raise machine.error
            await asyncio.gather(*senders)  # every average is out
        finally:
            tasks = [*senders, *([watchdog] if watchdog is not None else [])]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            machine.finish()
        await self._recover()

    async def _recover(self) -> None:
        """Finish the parts dead reducers left open with the survivors that agree on them
        (:mod:`peer.averaging.allreduce.recovery`), and write the result into their slots."""
        machine = self.round
        self._over = True
        plan = plan_recovery(
            machine.group,
            machine.members,
            machine.partition,
            machine.orphans,
            machine.left,
            self._candidates,
        )
        early, self._recovery_early = self._recovery_early, []
        self._recovery_early_bytes = 0
        mine = plan.group.group_id if plan is not None else None
        for sender, frame in early:
            g = frame.fields["g"]
            if mine is None or not (g == mine or is_recovery_of(mine, g)):
                self._not_in_recovery(sender, frame)
        if plan is None:
            return
        if self.depth >= MAX_RECOVERY_DEPTH:
            # heir after heir gave up: most likely the others run another recovery (their
            # view of the round differs) and never meet this one; the parts stay at this
            # member's own values rather than wait on, each level longer than the last
            logger.info(
                "%s: %d recoveries deep, parts of %d spans keep their own values",
                self.prefix,
                self.depth,
                len(plan.slots),
            )
            ours = plan.group.group_id
            for sender, frame in early:
                if frame.fields["g"] == ours or is_recovery_of(ours, frame.fields["g"]):
                    self._not_in_recovery(sender, frame)
            return
        flat = plan.gather(machine.orphans, machine.flat.dtype)
        self.recovery = AllreduceRunner(
            self.core,
            self.prefix,
            plan.group,
            plan.members,
            FlatLayout.from_tensors([flat]),
            flat,
            weight=machine.weight,
            compression=NoCompression(),  # a few parts, exact: nothing to save
            roles=None,
            # members give the dead reducer up at different times (each when it has been
            # silent for reducer_timeout since what that member last had of it): the
            # recovery waits that much longer for the others to begin theirs
            config=dataclasses.replace(
                self.config,
                sender_timeout=self.config.sender_timeout + self.config.reducer_timeout,
                reducer_timeout=2 * self.config.reducer_timeout,
            ),
            in_place=True,
            candidates=plan.candidates,
            depth=self.depth + 1,
        )
        ours = plan.group.group_id
        self.recovery.early.extend(
            f for f in early if f[1].fields["g"] == ours or is_recovery_of(ours, f[1].fields["g"])
        )
        try:
            await self.recovery.run()
        except BadContribution:
            await self.recovery.abort("its own values are not finite")
            raise
        finally:
            # each slot: the survivors' average, or (a part the recovery could not finish)
            # this member's own values, as the round left it
            for (r, i, _, _), (start, stop, values) in zip(
                plan.slots, plan.pieces(flat), strict=True
            ):
                view = machine.flat[start:stop]
                view.copy_(machine.orphans.parts[r][i].to(view.dtype))
                machine.results.write(view, values)
        recovery = self.recovery.round
        survivors = frozenset(set(recovery.peer_index) - recovery.left)
        nested = sorted(self.recovery.included.items())  # its own heir's parts, finished
        at = 0
        for _, _, start, stop in plan.slots:
            self.included.update(_pieces(start, stop, at, survivors, nested))
            at += stop - start

    def on_frame(self, sender: str, frame: Frame) -> None:
        """A part, an average or an abort for this round, or for a recovery of it, from
        ``sender`` (a link reader calls this inline)."""
        group_id = self.round.group.group_id
        g = frame.fields.get("g", group_id)
        if g == group_id:
            self._apply(self.round.on_frame(self._loop.time(), sender, frame))
            return
        if not is_recovery_of(group_id, g) or sender not in self.round.peer_index:
            return
        recovery = self.recovery
        if recovery is not None and (
            g == recovery.round.group.group_id or is_recovery_of(recovery.round.group.group_id, g)
        ):
            if recovery.started:
                recovery.on_frame(sender, frame)
            else:
                recovery.early.append((sender, frame))
        elif recovery is None and not self._over:
            # a survivor that began the recovery first: kept until this one knows its own
            # (an honest survivor sends it at most its values of the open parts)
            size = memoryview(frame.payload).nbytes
            if (
                len(self._recovery_early) < _RECOVERY_EARLY_FRAMES
                and self._recovery_early_bytes + size <= self._recovery_early_limit
            ):
                self._recovery_early.append((sender, frame))
                self._recovery_early_bytes += size
        else:
            self._not_in_recovery(sender, frame)

    def _not_in_recovery(self, sender: str, frame: Frame) -> None:
        """``frame`` is for a recovery this member does not run (its view of the round
        differs): say so at once, so that the sender's recovery goes on without it."""
        g = frame.fields["g"]
        if frame.type == ABORT or (g, sender) in self._told:
            return
        self._told.add((g, sender))
        abort = Frame(ABORT, {"p": self.prefix, "g": g, "why": "not in this recovery"})
        self._apply([Tell(sender, abort)])

    async def abort(self, reason: str) -> None:
        """Tell every member this peer leaves the round (best effort, bounded)."""
        frame = self.round.abort_frame(reason)
        await asyncio.gather(
            *(self._send_quietly(p, frame) for p in self.round.others_present),
            *([self.recovery.abort(reason)] if self.recovery is not None else []),
        )

    def _apply(self, commands: list[Command]) -> None:
        for command in commands:
            if isinstance(command, Wake):
                self._wakeups[command.peer_id].set()
            elif isinstance(command, Tell):
                task = self._loop.create_task(self._send_quietly(command.peer_id, command.frame))
                self._background.add(task)
                task.add_done_callback(self._background.discard)
            elif isinstance(command, Done):
                self._done.set()

    # ---------------------------------------------------------------- sending

    async def _link_to(self, peer_id: str) -> Link:
        loop = self._loop
        deadline = loop.time() + self.config.sender_timeout
        member = self.round.members[self.round.peer_index[peer_id]]
        while True:
            try:
                return await self.core.link(peer_id)
            except TransportError:
                # a client-mode peer has no address: wait for the link it opens to us
                if not member.client_mode or loop.time() >= deadline:
                    raise
                await asyncio.sleep(0.02)

    async def _sender(self, peer_id: str) -> None:
        machine = self.round
        wakeup = self._wakeups[peer_id]
        link: Link | None = None
        bulk = self.core.bulk
        timeout = self.config.sender_timeout  # of a send that makes no progress
        while True:
            send = machine.next_send(peer_id)
            if send is Idle.CLOSED:
                return
            if send is Idle.WAIT:
                wakeup.clear()
                await wakeup.wait()
                continue
            error: str | None = None
            try:
                if link is None or link.closed:
                    # lazily: two client-mode members never exchange anything (nor can)
                    link = await self._link_to(peer_id)
                if bulk is not None:
                    await bulk.send(peer_id, send.frame, timeout)  # a TCP lane if possible
                else:
                    async with asyncio.timeout(timeout):
                        await link.send(send.frame)
            except (SwarmgradError, TimeoutError, OSError) as exc:
                error = str(exc) or type(exc).__name__
            self._apply(machine.sent(self._loop.time(), send, error))
            if error is not None:
                return

    async def _send_quietly(self, peer_id: str, frame: Frame) -> None:
        with contextlib.suppress(SwarmgradError, TimeoutError):
            async with asyncio.timeout(1.0):
                await self.core.send(peer_id, frame)

    # ---------------------------------------------------------------- watchdog

    async def _watchdog(self) -> None:
        cfg = self.config
        tick = min(cfg.sender_timeout, cfg.reducer_timeout) / 4
        bulk = self.core.bulk
        # bytes of frames still under way count as signs of life (on a slow link one frame
        # can take longer than the timeouts); without lanes, only complete frames show
        heard = bulk.last_heard if bulk is not None else _never
        taken = bulk.last_taken if bulk is not None else _never
        while not self.round.done:
            await asyncio.sleep(tick)
            self._apply(self.round.tick(self._loop.time(), heard, taken))


def _pieces(
    start: int,
    stop: int,
    at: int,
    names: frozenset[str],
    nested: list[tuple[tuple[int, int], frozenset[str]]],
) -> dict[tuple[int, int], frozenset[str]]:
    """Who the slot ``start:stop`` of the round holds, laid out from ``at`` in its recovery's
    vector: ``names``, except where a recovery of the recovery (``nested``, in the
    recovery's coordinates) finished parts with others."""
    out: dict[tuple[int, int], frozenset[str]] = {}
    cursor = at
    end = at + stop - start
    for (lo, hi), inner in nested:
        lo, hi = max(lo, at), min(hi, end)
        if lo >= hi:
            continue
        if cursor < lo:
            out[(start + cursor - at, start + lo - at)] = names
        out[(start + lo - at, start + hi - at)] = inner
        cursor = hi
    if cursor < end:
        out[(start + cursor - at, stop)] = names
    return out


#: builds a round's runner; takes :class:`AllreduceRunner`'s arguments (what
#: :attr:`~peer.averaging.averager.DecentralizedAverager.runner_class` holds)
RunnerFactory = Callable[..., AllreduceRunner]
