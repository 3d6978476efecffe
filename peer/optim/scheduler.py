"""The learning-rate scheduler an optimizer steps once per swarm epoch, typed.

:class:`Scheduler` is what the optimizers use of one (any ``torch.optim.lr_scheduler``
scheduler whose ``step()`` takes no metric has it); :data:`SchedulerFactory` builds one on
the wrapped optimizer (e.g. ``functools.partial(torch.optim.lr_scheduler.StepLR, ...)``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch

from peer.formats.open_types import StateDict

__all__ = ["Scheduler", "SchedulerFactory"]


class Scheduler(Protocol):
    """A learning-rate scheduler as the optimizers use it."""

    def step(self) -> None: ...

    def state_dict(self) -> StateDict: ...

    def load_state_dict(self, state_dict: StateDict) -> None: ...


#: builds the scheduler on the wrapped optimizer
SchedulerFactory = Callable[[torch.optim.Optimizer], Scheduler]
