"""DASO's schedule, free of I/O: when to synchronise, and how the skips change with the loss.

Two pure pieces that :class:`~peer.optim.hierarchy.daso.DASO` drives: :class:`SkipSchedule` sets
``global_skip``, ``local_skip`` and ``batches_to_wait`` after every epoch from the epoch's
loss (warm-up, cycling, cool-down), and :func:`plan_batch` says what one batch does: a
global sync, the receive of the pending one, local synchronisation on or off.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass

__all__ = ["BatchPlan", "LocalSync", "Phase", "Plateau", "SkipSchedule", "plan_batch"]


class Phase(enum.Enum):
    WARMUP = "warm-up"
    CYCLING = "cycling"
    COOLDOWN = "cool-down"


class LocalSync(enum.Enum):
    """What happens to local gradient synchronisation from the next batch on."""

    KEEP = "keep"
    START = "start"
    STOP = "stop"


@dataclass
class Plateau:
    """Whether a loss has stopped improving: it has not beaten ``best * (1 - threshold)``
    for more than ``patience`` epochs in a row (then the count starts again)."""

    threshold: float
    patience: int = 2
    best: float = math.inf
    num_bad_epochs: int = 0

    def stable(self, value: float) -> bool:
        value = float(value)
        bar = (
            self.best * (1.0 - self.threshold)
            if self.best >= 0
            else self.best * (1.0 + self.threshold)
        )
        if value < bar:
            self.best = value
            self.num_bad_epochs = 0
        else:
            self.num_bad_epochs += 1
        if self.num_bad_epochs > self.patience:
            self.num_bad_epochs = 0
            return True
        return False

    def reset(self) -> None:
        self.best = math.inf
        self.num_bad_epochs = 0


@dataclass
class SkipSchedule:
    """``global_skip``, ``local_skip`` and ``batches_to_wait``, updated once per epoch from
    the epoch's (globally averaged) loss.

    Warm-up (the first ``warmup_epochs``): a blocking global sync after every batch, skips 0.
    Cycling: it starts with ``global_skip=4, local_skip=1, batches_to_wait=1``; each time the
    loss is *stable* (no relative improvement of ``stability_level`` over its best for more
    than two epochs) ``global_skip`` and ``local_skip`` are divided by
    ``skip_reduction_factor`` and ``batches_to_wait`` drops by one (each kept at least 1
    while ``global_skip`` is positive); stable at ``global_skip == 1`` resets them to
    ``max_global_skips``, ``max_global_skips // local_skip_factor`` and the same. Cool-down
    (the last ``cooldown_epochs``): blocking after every batch again."""

    total_epochs: int
    warmup_epochs: int = 4
    cooldown_epochs: int = 4
    stability_level: float = 0.05
    max_global_skips: int = 8
    skip_reduction_factor: int = 2
    local_skip_factor: int = 4
    global_skip: int = 0
    local_skip: int = 0
    batches_to_wait: int = 0

    def __post_init__(self) -> None:
        self.plateau = Plateau(self.stability_level)

    def phase(self, epoch: int) -> Phase:
        if epoch < self.warmup_epochs:
            return Phase.WARMUP
        if epoch >= self.total_epochs - self.cooldown_epochs:
            return Phase.COOLDOWN
        return Phase.CYCLING

    def after_epoch(self, epoch: int, loss: float) -> Phase:
        """Set the skips for the epoch that follows ``epoch`` (the number of epochs done),
        given its loss. Returns the phase that was decided."""
        phase = self.phase(epoch)
        if phase is Phase.WARMUP:
            self._set(0, 0, 0)
            return phase
        if epoch == self.warmup_epochs:
            self._set(4, 1, 1)
        if phase is Phase.COOLDOWN:
            self._set(0, 0, 0)
            return phase
        stable = self.plateau.stable(loss)
        if stable and self.global_skip > 1:
            self.global_skip //= self.skip_reduction_factor
            self.local_skip //= self.skip_reduction_factor
            self.batches_to_wait -= 1
            if self.global_skip > 0:
                self.batches_to_wait = max(self.batches_to_wait, 1)
                self.local_skip = max(self.local_skip, 1)
        elif stable and self.global_skip == 1:
            reset = self.max_global_skips // self.local_skip_factor
            self._set(self.max_global_skips, reset, reset)
        return phase

    def _set(self, global_skip: int, local_skip: int, batches_to_wait: int) -> None:
        self.global_skip = global_skip
        self.local_skip = local_skip
        self.batches_to_wait = batches_to_wait

    def reset(self) -> None:
        self.plateau.reset()
        self._set(0, 0, 0)


@dataclass(frozen=True)
class BatchPlan:
    """What one batch does after its local optimizer step."""

    global_sync: bool = False  # send now (and, if blocking, receive at once)
    batches_to_wait: int = 0  # for a global sync: batches until its average is applied
    receive: bool = False  # apply the pending global average now
    local: LocalSync = LocalSync.KEEP


def plan_batch(
    batch: int, last_batch: int, global_skip: int, local_skip: int, batches_to_wait: int
) -> BatchPlan:
    """The plan of batch ``batch`` (0-based) of an epoch whose last batch is
    ``last_batch``: a global sync every ``global_skip`` batches and on the last batch (its
    average applied ``batches_to_wait`` batches later, cut so that it lands within the
    epoch), the receive of the pending one, and whether the local level synchronises the
    next batch's gradients."""
    gs, ls = global_skip, local_skip
    gmod = batch % gs if gs > 0 else 0
    lmod = batch % ls if ls > 0 else 0
    following = batch + 1
    btw = batches_to_wait if batches_to_wait + batch <= last_batch else last_batch - batch
    if batch == last_batch or gmod == 0:
        return BatchPlan(global_sync=True, batches_to_wait=btw)
    if following % gs == 0:
        return BatchPlan(local=LocalSync.START)
    if gmod < btw:
        # between the send and the receive: the local level keeps going
        return BatchPlan(local=LocalSync.START if following == last_batch else LocalSync.KEEP)
    receive = gmod == btw
    local = LocalSync.STOP if receive and ls > 1 else LocalSync.KEEP
    if ls == 1 and following != last_batch:
        return BatchPlan(receive=receive, local=LocalSync.START)
    if lmod == 0:
        local = LocalSync.STOP
    elif following % max(ls, 1) == 0:
        local = LocalSync.START
    if following == last_batch:
        local = LocalSync.START
    return BatchPlan(receive=receive, local=local)
