"""DiLoCo's link to :mod:`peer.optim.catchup`, as a mixin over its attributes.

The catch-up policy itself is :class:`peer.optim.catchup.CatchUp`'s, shared by every
optimizer; :class:`peer.Optimizer` and :class:`peer.optim.DecentralizedOptimizer` build one
with explicit dependencies. :class:`peer.DiLoCo` still reaches it through this mixin, which
builds the :class:`~peer.optim.catchup.CatchUp` from the attributes declared below (the
outer state as a :class:`~peer.optim.live_state.LiveState`, its state averager, the progress
tracker) and supplies how a downloaded state is adopted.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any

import torch

from peer.optim.catchup import CatchUp, CatchUpHost, CatchUpPolicy
from peer.optim.live_state import LiveState
from peer.optim.progress import ProgressReport, ProgressTracker
from peer.optim.seam import SwarmNode
from peer.optim.state import StateSharingAverager

__all__ = ["JoiningSwarm"]


class JoiningSwarm:
    """Mixed into :class:`peer.DiLoCo`, whose attributes these are."""

    node: SwarmNode
    live: LiveState
    tracker: ProgressTracker
    state_averager: StateSharingAverager
    scheduler: Any
    local_epoch: int
    load_state_timeout: float
    _samples: int
    _acc: list[torch.Tensor]
    _averaged_grads: list[torch.Tensor]
    _closed: bool
    _closing: threading.Event

    if TYPE_CHECKING:  # provided by the host

        def _settle_pending(
            self, *, cancel: bool = False, timeout: float | None = None
        ) -> bool: ...

        def _live_state(self) -> AbstractContextManager[Any]: ...

        def _local_report(self) -> ProgressReport: ...

        def _report(self, new_samples: int = 0) -> None: ...

    def load_state_from_peers(self) -> bool:
        """Download the newest state and catch up with the swarm (:mod:`peer.optim.catchup`,
        retried within ``load_state_timeout``); True if a state was loaded."""
        return self._swarm_catch_up().run()

    def _swarm_catch_up(self) -> CatchUp:
        catch_up: CatchUp | None = self.__dict__.get("_catch_up")
        if catch_up is None:
            catch_up = CatchUp(
                CatchUpHost(
                    local_epoch=lambda: self.local_epoch,
                    settle=lambda: self._settle_pending(cancel=True),
                    report=self._local_report,
                    adopt=self._adopt_state,
                    move_to=self._move_to_epoch,
                ),
                node=self.node,
                tracker=self.tracker,
                averager=self.state_averager,
                policy=CatchUpPolicy(
                    timeout=self.load_state_timeout,
                    retry=True,
                    on_timeout="discount",
                    discount_s=self.load_state_timeout,
                ),
                closing=self._closing,
            )
            self.__dict__["_catch_up"] = catch_up
        return catch_up

    def _adopt_state(self, epoch: int, metadata: Any, tensors: Sequence[torch.Tensor]) -> None:
        with self._live_state():
            self.live.load(tensors)
            self._step_scheduler_to(epoch)
        self._start_epoch_at(epoch)

    def _move_to_epoch(self, epoch: int) -> None:
        """Move to the swarm's ``epoch`` keeping this peer's parameters (nobody can give
        theirs); what was accumulated for an older epoch is dropped, as after a download."""
        with self._live_state():
            self._step_scheduler_to(epoch)
        self._start_epoch_at(epoch)

    def _step_scheduler_to(self, epoch: int) -> None:
        if self.scheduler is not None:
            for _ in range(epoch - self.live.epoch):
                self.scheduler.step()
        self._set_state_epoch(epoch)

    def _start_epoch_at(self, epoch: int) -> None:
        with torch.no_grad():
            for buffer in (self._acc, self._averaged_grads):
                for g in buffer:
                    g.zero_()
        self._samples = 0
        self.local_epoch = epoch
        self._report()

    def _set_state_epoch(self, epoch: int) -> None:
        """The live state now belongs to ``epoch``. It is also the state's sharing priority, so
        newcomers download the newest state rather than a straggler's (hivemind does the
        same). Live-state lock held; any thread."""
        self.live.epoch = epoch
        self.state_averager.state_sharing_priority = float(epoch)
