"""One averaging round of the collaborative optimizer, among the run's peers, called off
once nobody can join it.

A round is skipped when no other peer of the run has a live progress report (a lone peer
does not wait out ``averaging_timeout`` every epoch); a peer that is there but behind still
gets the chance to join: the round looks for a group as usual. While the round looks for a
group, it is called off as soon as nobody can join it any more: every other peer either
reports a later epoch (announced only after that epoch's rounds ended), withdrew from this
round's matchmaking (its group began without this peer) or left the swarm (its membership
expired: a crash, a network split; its last report outlives it), or none reports at all. If
others moved on from a gradient round, this peer is :attr:`RoundRunner.behind`: rather than
step alone and drift from them, it skips the epoch and loads their state at its next step.
Runs on the training thread, or on the background thread with a ``delay_*`` option.
"""

from __future__ import annotations

import logging
import threading

from peer.averaging.averager import DecentralizedAverager
from peer.averaging.control import StepControl
from peer.averaging.exceptions import StepFailed
from peer.formats.open_types import UserMetadata
from peer.optim.collaborative.epochs import EpochRun
from peer.optim.shared.pending import Pending
from peer.optim.shared.progress import ProgressTracker

__all__ = ["ROUND_RECHECK_S", "RoundRunner"]

logger = logging.getLogger("peer.optim.collaborative")

#: how often a round that looks for a group checks whether anyone can still join it
ROUND_RECHECK_S = 0.25


class RoundRunner:
    """Runs rounds for one optimizer and counts their outcomes (for progress reports:
    rounds that found nobody to average with, a lone peer's, count as neither).

    ``pending.round`` holds the round in flight, so that it can be interrupted; ``closing``
    is set when the optimizer shuts down (a round failing then is not counted)."""

    def __init__(
        self,
        *,
        tracker: ProgressTracker,
        peer_id: str,
        timeout: float,
        pending: Pending[EpochRun],
        closing: threading.Event,
    ) -> None:
        self.tracker = tracker
        self.peer_id = peer_id
        self.timeout = timeout
        self.pending = pending
        self.closing = closing
        self.rounds_done = 0
        self.rounds_failed = 0
        self.last_group_size: int | None = None
        self.last_failure: str | None = None  # class name of the last failed round's error
        # set when a gradient round was called off because the others averaged without
        # this peer: it loads their state at its next step instead of stepping alone
        self.behind = False

    def run(
        self,
        averager: DecentralizedAverager,
        *,
        weight: float,
        gather: UserMetadata,
        epoch: int,
        what: str,
        fallback: str,
        gradients: bool,
        level: int = logging.WARNING,
    ) -> dict[str, UserMetadata] | None:
        """One round of ``averager`` (``gradients``: the epoch's gradient round, which others
        may have left this peer behind in); None (logged as ``what``, then ``fallback``) if
        it failed, was cancelled or was skipped, else the gathered group."""
        if self.pending.interrupted:
            logger.info("%s called off (interrupted); %s", what, fallback)
            return None
        if not self.tracker.others_reporting():
            logger.debug("%s skipped: no other peer in the run; %s", what, fallback)
            return None
        try:
            control = averager.step(weight=weight, timeout=self.timeout, gather=gather, wait=False)
            assert isinstance(control, StepControl)  # wait=False always returns one
            self.pending.round = control
            if self.pending.interrupted:  # (an interrupt() just before the round was set)
                control.cancel()
            result = self._await(averager, control, epoch, gradients=gradients)
        except StepFailed as exc:
            if self.pending.interrupted:
                logger.info("%s called off (interrupted); %s", what, fallback)
            elif not self.closing.is_set() and not (self.behind and gradients):
                self.rounds_failed += 1
                self.last_failure = type(exc).__name__
                logger.log(level, "%s failed (%s); %s", what, exc, fallback)
            return None
        except RuntimeError:
            if self.closing.is_set():  # the averager shut down under us
                return None
            raise
        finally:
            self.pending.round = None
        self.rounds_done += 1
        self.last_group_size = len(result)
        return result

    def _await(
        self, averager: DecentralizedAverager, control: StepControl, epoch: int, *, gradients: bool
    ) -> dict[str, UserMetadata]:
        """The round's result (peer id → what it gathered); called off once nobody can join it (module docstring)."""
        while True:
            try:
                result: dict[str, UserMetadata] = control.result(timeout=ROUND_RECHECK_S)
                return result
            except TimeoutError:
                pass
            if control.began_allreduce:
                result = control.result()
                return result
            others = [r for r in self.tracker.present() if r.peer_id != self.peer_id]
            withdrawn = averager.withdrawn_peers()
            if all(r.epoch > epoch or r.peer_id in withdrawn for r in others) and control.cancel():
                if others and gradients:
                    self.behind = True
                    logger.info(
                        "epoch %d: the other peers averaged without this one; it will load "
                        "their state instead of stepping alone",
                        epoch,
                    )
                else:
                    logger.info("epoch %d: the other peers moved on; calling its round off", epoch)
                result = control.result()
                return result
