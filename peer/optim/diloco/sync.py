"""How :class:`peer.DiLoCo` runs one sync's round: wait for the peers still on their way,
find a group, average, and judge the outcome.

Mixed into :class:`peer.optim.diloco.outer.DiLoCo` (whose attributes these are), one idea apart
from the optimizer's bookkeeping: who to wait for and how long
(:func:`~peer.optim.diloco.sync_schedule.stragglers`, at most about as long as this peer's own
inner steps took), when a round nobody can join any more is called off, and when a
finished round does not count (a member left it mid-way: the span it reduced kept each
peer's own values, so the members' results may differ, and outer states must not).
Runs on the training thread, or on the background thread with ``overlap``.
"""

from __future__ import annotations

import concurrent.futures
import logging
import math
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from peer.averaging.averager import DecentralizedAverager
from peer.averaging.control import StepControl
from peer.averaging.exceptions import AllreduceTimeout, MatchmakingFailed, StepFailed
from peer.formats.open_types import UserMetadata
from peer.optim.diloco.sync_schedule import RoundTimer, steps_before_sync, stragglers
from peer.optim.seam import SwarmNode
from peer.optim.shared.pending import Pending
from peer.optim.shared.progress import PerformanceEMA, ProgressTracker

__all__ = ["SyncRounds", "SyncRun"]

logger = logging.getLogger("peer.optim.diloco")

#: how often a peer waiting for its round's group checks who can still come
ROUND_RECHECK_S = 0.1


@dataclass
class SyncRun:
    """One sync in progress: what its round needs, then what it produced."""

    sync: int
    fragment: int
    samples: int
    snapshot: list[torch.Tensor] | None = None  # the fragment's parameters at the start
    future: concurrent.futures.Future[None] | None = None
    averaged: bool = False  # the buffer holds the round's (or a lone peer's) result
    failed: bool = False  # other peers were about but the round did not complete
    cancelled: bool = False


class SyncRounds:
    """Mixed into :class:`peer.DiLoCo`, whose attributes these are."""

    node: SwarmNode
    tracker: ProgressTracker
    averagers: list[DecentralizedAverager]
    timer: RoundTimer
    fragments: list[list[int]]
    inner_steps: int
    matchmaking_time: float
    straggler_silence: float
    overlap: bool
    verbose: bool
    rounds_done: int
    rounds_failed: int
    round_seconds: float
    straggler_wait_seconds: float
    last_group_size: int | None
    last_failure: str | None
    _round_mates: tuple[int, frozenset[str]]
    _sync_in_group_bits: bool
    _phase_seconds: float | None
    _step_seconds: PerformanceEMA
    _pending: Pending[SyncRun]
    _behind: bool
    _closed: bool
    _closing: threading.Event

    if TYPE_CHECKING:  # provided by peer.DiLoCo

        def _report(self, new_samples: int = 0) -> None: ...

    def _run_round(self, run: SyncRun) -> None:
        """Average the fragment's pseudo-gradient with the peers at this sync. Any thread."""
        begun = time.monotonic()
        try:
            waited = self._wait_for_stragglers(run.sync)
            self.straggler_wait_seconds += time.monotonic() - begun
            if not waited:
                run.cancelled = True
                return
            self._average(run)
        finally:
            self.round_seconds += time.monotonic() - begun

    def _average(self, run: SyncRun) -> None:
        averager = self.averagers[run.fragment]
        if not self.tracker.others_reporting():
            run.averaged = True  # alone in the run: this peer's pseudo-gradient is the mean
            return
        if self._sync_in_group_bits:
            averager.set_group_bits(format(run.sync % (1 << 16), "016b"))
        else:  # fresh pseudo-gradients: even groups, their weight stays the samples
            peers, clients = self.tracker.peers_at(run.sync)
            averager.place_on_grid(peers, run.sync // len(self.averagers), clients)
        started = time.monotonic()
        averager.last_group = frozenset()  # (no all-reduce begun: nobody holds a result)
        try:
            control = averager.step(
                weight=float(run.samples),
                gather={"sync": run.sync, "samples": run.samples},
                timeout=self.timer.timeout(),
                wait=False,
            )
            assert isinstance(control, StepControl)  # wait=False always returns one
            self._pending.round = control
            if self._pending.interrupted:  # (an interrupt() just before the round was set)
                control.cancel()
            group = self._await_round(control, run.sync)
        except StepFailed as exc:
            if self._closed:
                run.cancelled = True
                return
            if self._pending.interrupted:
                run.failed = True
                logger.info("sync %d: averaging called off; retrying at the next step", run.sync)
                return
            if isinstance(exc, AllreduceTimeout | MatchmakingFailed):
                self.timer.timed_out()
            if self._behind:
                return
            self.rounds_failed += 1
            self.last_failure = type(exc).__name__
            run.failed = True
            logger.warning(
                "sync %d: averaging failed (%s); retrying at the next step", run.sync, exc
            )
            return
        except RuntimeError:
            if self._closed:  # the averager shut down under us
                run.cancelled = True
                return
            raise
        finally:
            self._pending.round = None
            # whoever began this sync's all-reduce with this peer may hold its result when
            # this peer does not: a state of the next sync from them extends this peer's own
            self._round_mates = (run.sync, averager.last_group - {self.node.peer_id})
        self.timer.succeeded(time.monotonic() - started)
        left = averager.last_round_left
        if left:
            # the span a departed reducer held kept this peer's own values: the members'
            # results may differ, and outer states must not. Retried among those that stayed
            # (a member whose round completed moves on, and this one then loads its state).
            self.rounds_failed += 1
            self.last_failure = "MemberLeft"
            run.failed = True
            logger.warning(
                "sync %d: %d peer(s) left mid-round (%s); retrying at the next step",
                run.sync,
                len(left),
                ", ".join(sorted(left)),
            )
            return
        self.rounds_done += 1
        self.last_group_size = len(group)
        run.averaged = True
        if self.verbose:
            logger.info(
                "sync %d: averaged fragment %d with %d peers", run.sync, run.fragment, len(group)
            )

    def _wait_for_stragglers(self, sync: int) -> bool:
        """Wait (at most about as long as this peer's inner steps took) for the peers still
        on their way to this sync; False if shut down meanwhile."""
        target = steps_before_sync(sync, self.inner_steps, len(self.fragments))
        limit = max(self._phase_seconds or 0.0, 2.0 * self.matchmaking_time)
        deadline = time.monotonic() + limit
        while not self._closed:
            self._report()
            reports = self.tracker.fetch(fresh=True)
            waiting = stragglers(
                reports,
                me=self.node.peer_id,
                sync=sync,
                target_steps=target,
                now=self.node.get_time(),
                stale_after=self._stale_after(),
            )
            if self.overlap:  # one sync behind: its previous round still runs; coming too
                waiting += stragglers(
                    reports,
                    me=self.node.peer_id,
                    sync=sync - 1,
                    target_steps=math.inf,
                    now=self.node.get_time(),
                    stale_after=self._stale_after(),
                )
            if not waiting or time.monotonic() >= deadline:
                return True
            self._closing.wait(ROUND_RECHECK_S)
        return False

    def _stale_after(self) -> float:
        rate = self._step_seconds.samples_per_second
        step_time = 1.0 / rate if rate > 0 else 0.0
        return max(self.straggler_silence, 4.0 * step_time)

    def _await_round(self, control: StepControl, sync: int) -> dict[str, UserMetadata]:
        """The round's result. While it looks for a group it is called off when nobody can
        join any more: no other peer reports, or every other one reports a later sync (it
        ended this sync's round without this peer, which is then behind and loads their
        state). Peers that merely left matchmaking are not taken as gone: they may be in
        this very group, assembled a moment before this peer learns of it."""
        while True:
            try:
                result: dict[str, UserMetadata] = control.result(timeout=ROUND_RECHECK_S)
                return result
            except TimeoutError:
                pass
            if control.began_allreduce:
                result = control.result()
                return result
            self._report()
            others = [r for r in self.tracker.fetch() if r.peer_id != self.node.peer_id]
            if all(r.epoch > sync for r in others) and control.cancel():
                if others:
                    self._behind = True
                    logger.info(
                        "sync %d: the other peers averaged without this one; loading their state",
                        sync,
                    )
                result = control.result()
                return result
