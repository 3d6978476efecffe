"""The end of a collaborative epoch, planned: which phases run, and where.

An epoch of :class:`peer.Optimizer` ends in up to three phases, in this order: the gradient
round (:attr:`Phase.GRADIENTS`), the optimizer step with the scheduler's
(:attr:`Phase.STEP`) and the state round (:attr:`Phase.STATE`). Each ``delay_*`` option
moves its phase, and so every phase after it, to the background thread.
:func:`plan_epoch` decides all of it from the options and the epoch's facts; it is pure and
tested without torch or sockets. :class:`EpochRun` is what running the plan produces (the
background thread writes it; the training thread reads it once the run has finished).
"""

from __future__ import annotations

import concurrent.futures
import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from peer.optim.collaborative.options import CollaborativeOptions

if TYPE_CHECKING:
    import torch

__all__ = ["EpochPlan", "EpochRun", "Phase", "plan_epoch"]


class Phase(enum.Enum):
    GRADIENTS = "gradient round"
    STEP = "optimizer step"
    STATE = "state round"


@dataclass(frozen=True)
class EpochPlan:
    epoch: int
    samples: int  # this peer's samples in the epoch (its weight in the gradient round)
    share: float  # this peer's part of the target batch, in samples
    optimizer_step: bool  # the wrapped optimizer steps (not on an auxiliary peer)
    inline: tuple[Phase, ...]  # run by the training thread, in step()
    background: tuple[Phase, ...]  # then these, in the background thread

    @property
    def phases(self) -> tuple[Phase, ...]:
        return self.inline + self.background

    @property
    def holds_announcement(self) -> bool:
        """A round runs in the background: the next epoch is announced once it ended, so a
        peer slow to notice the target still finds the others in the round."""
        return any(p in (Phase.GRADIENTS, Phase.STATE) for p in self.background)


def plan_epoch(
    options: CollaborativeOptions,
    *,
    epoch: int,
    samples: int,
    swarm_samples: int,
    target_batch_size: int,
    average_state_every: int,
    auxiliary: bool,
) -> EpochPlan:
    """Plan the end of ``epoch``, at which this peer accumulated ``samples`` of the
    ``swarm_samples`` the swarm reported."""
    averaging = not options.use_local_updates
    state_round = (options.use_local_updates or (epoch + 1) % average_state_every == 0) and not (
        auxiliary and averaging
    )
    wanted = [
        (Phase.GRADIENTS, averaging, options.delay_grad_averaging),
        (Phase.STEP, True, options.delay_optimizer_step),
        (Phase.STATE, state_round, options.delay_state_averaging),
    ]
    inline: list[Phase] = []
    background: list[Phase] = []
    deferring = False  # from the first delayed phase on, wanted or not, all is background
    for phase, wanted_here, delayed in wanted:
        deferring = deferring or delayed
        if wanted_here:
            (background if deferring else inline).append(phase)
    swarm = max(swarm_samples, target_batch_size)
    return EpochPlan(
        epoch=epoch,
        samples=samples,
        share=target_batch_size * samples / swarm,
        optimizer_step=averaging and not auxiliary,
        inline=tuple(inline),
        background=tuple(background),
    )


@dataclass(eq=False)
class EpochRun:
    """A plan being run, and what it produced."""

    plan: EpochPlan
    cancelled: bool = False  # stop at the next phase (a state download replaces this run)
    stepped: bool = False  # the optimizer's parameters changed (copy them to the model)
    state_version: int = -1  # the live state's version when the state round took its copy
    state_snapshot: list[torch.Tensor] | None = None  # that copy (use_local_updates: steps go on)
    state_averaged: list[torch.Tensor] | None = None  # the state round's result
    future: concurrent.futures.Future[None] | None = field(default=None, repr=False)
