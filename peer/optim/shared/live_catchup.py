"""The wiring an optimizer with a shared live state needs to catch up with the swarm.

:class:`peer.Optimizer` and :class:`peer.DiLoCo` each keep a *live state*
(:class:`~peer.optim.shared.live_state.LiveState`, served to newcomers by a
:class:`~peer.optim.shared.optimizer_state.SharedLiveState`), run at most one piece of work in the
background (:class:`~peer.optim.shared.pending.Pending`) and count swarm epochs with progress
reports. Mixed into both, :class:`LiveCatchUp` is what they share: the
:class:`~peer.optim.shared.catchup.CatchUp` they are driven by (retried within
``load_state_timeout``, then the claims ahead are discounted), how a downloaded state or a later
epoch is taken on, settling the background run, the progress report and shutting down. Each
optimizer says what an epoch's start means to it (:meth:`LiveCatchUp._start_epoch_at`), how a
finished background run lands (:meth:`LiveCatchUp._land`) and where its progress stands
(:meth:`LiveCatchUp._progress`). Training thread throughout.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import threading
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Generic, Self

import torch

from peer.averaging.averager import DecentralizedAverager
from peer.formats.open_types import StateDict
from peer.optim.seam import SwarmNode
from peer.optim.shared.catchup import CatchUp, CatchUpHost, CatchUpPolicy
from peer.optim.shared.live_state import LiveState
from peer.optim.shared.optimizer_state import SharedLiveState, StateSharingAverager
from peer.optim.shared.pending import Pending, RunT
from peer.optim.shared.progress import (
    PerformanceEMA,
    ProgressReport,
    ProgressTracker,
    SwarmProgress,
)

__all__ = ["LiveCatchUp"]


class LiveCatchUp(Generic[RunT]):
    """Mixed into :class:`peer.Optimizer` and :class:`peer.DiLoCo`, whose attributes these
    are (see the module docstring)."""

    node: SwarmNode
    tracker: ProgressTracker
    live: LiveState
    shared: SharedLiveState
    state_averager: StateSharingAverager
    performance: PerformanceEMA
    client_mode: bool
    local_epoch: int
    catch_up: CatchUp
    _pending: Pending[RunT]
    _executor: concurrent.futures.ThreadPoolExecutor | None
    _closing: threading.Event
    _closed: bool

    # --------------------------------------------------------- what each one says

    if TYPE_CHECKING:  # what the class it is mixed into provides

        def _start_epoch_at(self, epoch: int) -> None:
            """After a download or a move: this peer's work starts over towards ``epoch``."""
            ...

        def _land(self, run: RunT) -> None:
            """Apply a finished (or cancelled) background run."""
            ...

        def _progress(self) -> tuple[int, int, int]:
            """``(epoch, done at it, done in total)`` for this peer's progress report."""
            ...

        def _round_averagers(self) -> Sequence[DecentralizedAverager]:
            """The averagers of the rounds (the state averager is stopped apart)."""
            ...

        def load_state_dict(self, state: StateDict) -> None:
            """Restore what ``state_dict()`` returned."""
            ...

    def _step_scheduler(self) -> None:
        """One swarm epoch passed while catching up (default: nothing steps)."""

    # ------------------------------------------------------------------ catching up

    def _wire_catch_up(
        self,
        load_state_timeout: float,
        round_mates: Callable[[int], frozenset[str]] | None = None,
    ) -> None:
        """Build :attr:`catch_up`: retry within ``load_state_timeout``, then discount the
        claims ahead and go on at this peer's own epoch (rounds need the others' state, not
        just their epoch). ``round_mates``: see :class:`~peer.optim.shared.catchup.CatchUpHost`."""
        host = CatchUpHost(
            local_epoch=lambda: self.local_epoch,
            settle=lambda: self._settle_pending(cancel=True),
            report=self._local_report,
            adopt=self._adopt_state,
            move_to=self._move_to_epoch,
            # past epoch 0 this peer took part in the run: its state is worth keeping
            holds_state=lambda: self.local_epoch > 0,
        )
        if round_mates is not None:
            host = dataclasses.replace(host, round_mates=round_mates)
        self.catch_up = CatchUp(
            host,
            node=self.node,
            tracker=self.tracker,
            averager=self.state_averager,
            policy=CatchUpPolicy(
                timeout=load_state_timeout,
                retry=True,
                on_timeout="discount",
                discount_s=load_state_timeout,
            ),
            closing=self._closing,
        )

    def load_state_from_peers(self) -> bool:
        """Download the live state (parameters, optimizer state, epoch) from the peer with
        the newest, and catch up with the swarm; True if a state was loaded. A background
        run still in progress is abandoned first (the state replaces it). While this peer
        is still behind the swarm's epoch as it stood when the download began, the
        download is retried with backoff for ``load_state_timeout`` seconds in all: a
        newcomer joining a running swarm starts from the swarm's state, not from scratch.
        The policy — from whom, when to give up, what then — is
        :mod:`peer.optim.shared.catchup`'s."""
        return self.catch_up.run()

    def load_checkpoint(self, model: torch.nn.Module, checkpoint: StateDict) -> None:
        """Take a volunteer's checkpoint (``{"model": ..., "optimizer": ...}``, as uploaded)
        as this peer's state: its ``"model"`` into ``model``, its ``"optimizer"`` into this
        optimizer; ``synchronised_state_dict(model)`` then gives the checkpoint's model.
        ``ValueError`` or ``RuntimeError`` (``load_state_dict``'s) if it does not fit this
        model. Training thread."""
        with torch.no_grad():
            model.load_state_dict(checkpoint["model"])
        with self.shared.lock():
            self.live.copy_from_model()  # (offloaded parameters)
        self.load_state_dict(checkpoint["optimizer"])

    def _adopt_state(self, epoch: int, metadata: object, tensors: Sequence[torch.Tensor]) -> None:
        """A downloaded state, at ``epoch``, replaces this peer's (``ValueError``: it does not
        fit, nothing changed)."""
        with self.shared.lock():
            self.live.load(tensors)
            self.shared.move_to(epoch, self._step_scheduler)
        self._start_epoch_at(epoch)

    def _move_to_epoch(self, epoch: int) -> None:
        """Move to the swarm's ``epoch`` keeping this peer's state (nobody can give theirs);
        the work done towards an older epoch is dropped, as after a download."""
        with self.shared.lock():
            self.shared.move_to(epoch, self._step_scheduler)
        self._start_epoch_at(epoch)

    # ------------------------------------------------------------- background run

    @property
    def pending_update(self) -> bool:
        """True while a background run (a delayed epoch, an overlapped round) has not been
        applied yet."""
        return self._pending.run is not None

    def _settle_pending(self, *, cancel: bool = False, timeout: float | None = None) -> bool:
        """Wait for the background run and apply it (with ``cancel``, it stops at its next
        stage and a round in flight is called off). False if it still runs after
        ``timeout``."""
        return self._pending.settle(self._land, cancel=cancel, timeout=timeout)

    def interrupt(self) -> None:
        """Call off the averaging round in flight, if any, and the rounds of the epoch (or
        sync) under way that have not begun; safe from any thread (e.g. a signal handler's).
        The step running them goes on as after failed rounds (the collaborative optimizer
        steps with this peer's own gradients)."""
        self._pending.interrupt()

    def wait_for_pending(self, timeout: float | None = None) -> bool:
        """Wait until background work has finished and apply its result to the model —
        e.g. after the last ``step()``, before evaluating or saving. Returns False if it
        still runs after ``timeout`` seconds. Without background work there is never
        anything pending."""
        return self._settle_pending(timeout=timeout)

    # ------------------------------------------------------------------- progress

    @property
    def global_progress(self) -> SwarmProgress:
        """The swarm's progress towards its next epoch."""
        return self.tracker.progress(self._local_report())

    def report_presence(self) -> None:
        """Publish this peer's progress report again as it stands, while it takes no step
        (a paused run): reports expire, and a peer whose report lapsed is not counted, so
        the first peer to resume would find nobody reporting, skip the rounds as a lone
        peer and train on alone. Call it at least every half expiration."""
        self._report()

    def _local_report(self) -> ProgressReport:
        epoch, done, total = self._progress()
        return ProgressReport(
            self.node.peer_id,
            epoch,
            done,
            total,
            self.node.get_time(),
            self.performance.samples_per_second,
            self.client_mode,
        )

    def _report(self, new_samples: int = 0) -> None:
        if new_samples:
            self.performance.update(new_samples)
        self.tracker.report(self._local_report())

    def _with_shared_buffers(self, model: torch.nn.Module, state: dict[str, torch.Tensor]) -> None:
        """Put the shared values of the model's buffers given to this optimizer (integer
        ones rounded) into ``state``, a ``model.state_dict()``."""
        buffers = self.live.buffers
        with self.shared.lock():
            shared = dict(zip(map(id, buffers.model), buffers.state_values(), strict=True))
        for name, b in model.named_buffers(remove_duplicate=False):
            if id(b) in shared and name in state:
                state[name] = shared[id(b)].clone()

    # ------------------------------------------------------------------ lifetime

    def shutdown(self) -> None:
        """Stop background work at once (a round in flight is cancelled, a pending update
        is dropped: call :meth:`wait_for_pending` first to keep it), then the averagers;
        the progress report is retracted. The node is not shut down. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._closing.set()
        self._pending.call_off()
        self.tracker.shutdown()
        for averager in self._round_averagers():
            averager.shutdown()  # cancels its steps: a background round ends now
        self.state_averager.shutdown()
        if self._executor is not None:
            self._executor.shutdown(wait=True, cancel_futures=True)
        self._pending.run = None

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.shutdown()
