"""What each phase of a collaborative epoch does to the live state.

:mod:`peer.optim.collaborative.epochs` plans an epoch's phases (the gradient round, the optimizer
step with the scheduler's, the state round) and which of them run in the background;
:class:`EpochPhases` runs them — on the training thread, or on the background thread — and
:meth:`EpochPhases.apply` brings a finished run to the model on the training thread.

The live state is read and written under its lock
(:meth:`peer.optim.shared.optimizer_state.SharedLiveState.lock`, the state averager's), which also
guards the snapshot served to newcomers; see "Locking" in :mod:`peer.optim.collaborative.optimizer`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

import torch

from peer.averaging.averager import DecentralizedAverager
from peer.optim.collaborative.epochs import EpochRun, Phase
from peer.optim.collaborative.rounds import RoundRunner
from peer.optim.shared.optimizer_state import SharedLiveState

__all__ = ["EpochPhases"]

logger = logging.getLogger("peer.optim.collaborative")


class EpochPhases:
    """The phases of :class:`peer.Optimizer`'s epochs, over its live state and averagers.

    ``shared`` is the live state with its averager (the state rounds'); ``step_scheduler``
    steps the optimizer's scheduler (if any) once. ``epoch_in_group_bits``:
    rounds of different epochs never meet (the epoch is their group key; without a
    ``target_group_size``). With one, each round takes its place on the Moshpit grid of the
    run's peers at its epoch (:meth:`DecentralizedAverager.place_on_grid`): the gradient
    round with epoch ``e`` as its round index (fresh gradients keep their samples as weight),
    the state round, run every ``average_state_every`` epochs, with ``e //
    average_state_every`` and the grid's weight (parameters carry over from round to round)."""

    def __init__(
        self,
        *,
        shared: SharedLiveState,
        grad_averager: DecentralizedAverager,
        rounds: RoundRunner,
        step_scheduler: Callable[[], None],
        auxiliary: bool,
        use_local_updates: bool,
        epoch_in_group_bits: bool,
        average_state_every: int,
        verbose: bool,
    ) -> None:
        self.shared = shared
        self.live = shared.live
        self.grad_averager = grad_averager
        self.state_averager = shared.averager
        self.rounds = rounds
        self.step_scheduler = step_scheduler
        self.auxiliary = auxiliary
        self.use_local_updates = use_local_updates
        self.epoch_in_group_bits = epoch_in_group_bits
        self.average_state_every = average_state_every
        self.verbose = verbose

    def run(self, run: EpochRun, phases: Sequence[Phase]) -> None:
        """Run some of an epoch's phases, in order: here or in the background thread."""
        for phase in phases:
            if run.cancelled:
                return
            if phase is Phase.GRADIENTS:
                self._average_gradients(run)
            elif phase is Phase.STEP:
                self._optimizer_step(run)
            else:
                self._average_state(run)

    def _average_gradients(self, run: EpochRun) -> None:
        epoch, samples = run.plan.epoch, run.plan.samples
        if self.epoch_in_group_bits:
            self.grad_averager.set_group_bits(format(epoch % (1 << 16), "016b"))
        else:
            peers, clients = self.rounds.tracker.peers_at(epoch)
            self.grad_averager.place_on_grid(peers, epoch, clients)
        group = self.rounds.run(
            self.grad_averager,
            weight=0.0 if self.auxiliary else float(samples),
            gather={"epoch": epoch, "samples": samples},
            epoch=epoch,
            what=f"epoch {epoch}: gradient averaging",
            fallback="stepping with local gradients",
            gradients=True,
        )
        if self.verbose and group is not None:
            logger.info("epoch %d: averaged gradients with %d peers", epoch, len(group))
        if group is None and self.rounds.behind:
            run.cancelled = True  # no step: the others' state replaces this epoch
        with self.grad_averager.get_tensors() as grads, torch.no_grad():
            if run.plan.optimizer_step and not run.cancelled:
                with self.shared.lock():
                    self.live.set_grads(list(grads))
            for g in grads:
                g.zero_()  # without delay_grad_averaging they accumulate the next epoch

    def _optimizer_step(self, run: EpochRun) -> None:
        with self.shared.lock():
            if run.plan.optimizer_step:
                self.live.opt.step()
                run.stepped = True
            self.step_scheduler()
            self.shared.set_epoch(run.plan.epoch + 1)

    def _average_state(self, run: EpochRun) -> None:
        # (the live state's lock is the state averager's: its tensors are under it too)
        with self.state_averager.get_tensors() as shared, torch.no_grad():
            for mine, s in zip(self.live.tensors(), shared, strict=True):
                s.copy_(mine)
            run.state_version = self.live.version
            if self.use_local_updates:  # local steps may change the live state meanwhile
                run.state_snapshot = [s.clone() for s in shared]
        weight = 1.0
        if self.epoch_in_group_bits:
            self.state_averager.set_group_bits(format((run.plan.epoch + 1) % (1 << 16), "016b"))
        else:
            peers, clients = self.rounds.tracker.peers_at(run.plan.epoch)
            weight = self.state_averager.place_on_grid(
                peers, run.plan.epoch // self.average_state_every, clients
            )
        group = self.rounds.run(
            self.state_averager,
            weight=0.0 if self.auxiliary else weight,
            gather=None,
            epoch=run.plan.epoch,
            what=f"epoch {run.plan.epoch}: state averaging",
            fallback="skipped",
            gradients=False,
            level=logging.DEBUG,
        )
        if group is not None:
            with self.state_averager.get_tensors() as shared:
                run.state_averaged = [s.clone() for s in shared]

    def apply(self, run: EpochRun) -> None:
        """Bring a finished epoch's results to the model. Training thread."""
        with self.shared.lock():
            if run.state_averaged is not None:
                if self.live.version == run.state_version or run.state_snapshot is None:
                    self.live.load(run.state_averaged)
                else:
                    # local steps were taken during the round: keep them, add the round's change
                    self.live.load(
                        [
                            t + (a - s)
                            for t, a, s in zip(
                                self.live.tensors(),
                                run.state_averaged,
                                run.state_snapshot,
                                strict=True,
                            )
                        ]
                    )
            elif run.stepped:
                self.live.copy_to_model()
