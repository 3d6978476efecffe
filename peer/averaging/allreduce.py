"""One butterfly all-reduce round over the node's links: the driver of
:class:`~peer.averaging.butterfly.ButterflyRound`.

The round's rules — who reduces what, batching, in-place results, every fault decision —
live in the machine (:mod:`peer.averaging.butterfly`); this module gives it time and I/O:

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

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Sequence
from typing import Any

import torch

from peer.averaging.butterfly import (
    AllreduceConfig,
    ButterflyRound,
    Command,
    Done,
    Idle,
    MemberInfo,
    Tell,
    Wake,
)
from peer.averaging.matchmaking import GroupInfo
from peer.averaging.partition import FlatLayout
from peer.averaging.seam import Link, NodeCore
from peer.compression import Compression, TensorRole
from peer.exceptions import SwarmgradError, TransportError
from peer.wire import Frame

__all__ = ["AllreduceConfig", "AllreduceRunner", "MemberInfo", "RoundFactory", "RunnerFactory"]

#: builds a round's machine; takes :class:`~peer.averaging.butterfly.ButterflyRound`'s arguments
RoundFactory = Callable[..., ButterflyRound]


def _never(peer_id: str) -> float:
    return 0.0


class AllreduceRunner:
    """Run one round: ``await run()``; afterwards ``flat`` holds the round's result (see
    :mod:`peer.averaging.butterfly` for the two modes). ``run()`` raises
    :class:`~peer.averaging.exceptions.BadContribution` if this peer's own values are bad.

    ``round_factory`` is for tests: it builds the round's machine in place of
    :class:`~peer.averaging.butterfly.ButterflyRound` (a subclass that misbehaves, to see
    the other members cope). Faults in sending are injected through ``core`` (a wrapper
    around the node's)."""

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
        scratch: Any = None,
        in_place: bool = False,
        alpha: float = 1.0,
        round_factory: RoundFactory = ButterflyRound,
    ) -> None:
        self.core = core
        self.round = round_factory(
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
        early, self.early = self.early, []
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

    def on_frame(self, sender: str, frame: Frame) -> None:
        """A part, an average or an abort for this round from ``sender`` (a link reader
        calls this inline)."""
        self._apply(self.round.on_frame(self._loop.time(), sender, frame))

    async def abort(self, reason: str) -> None:
        """Tell every member this peer leaves the round (best effort, bounded)."""
        frame = self.round.abort_frame(reason)
        await asyncio.gather(*(self._send_quietly(p, frame) for p in self.round.others_present))

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


#: builds a round's runner; takes :class:`AllreduceRunner`'s arguments (tests pass one that
#: misbehaves to :class:`~peer.averaging.averager.DecentralizedAverager`)
RunnerFactory = Callable[..., AllreduceRunner]
