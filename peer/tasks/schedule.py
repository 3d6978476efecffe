"""The learning rate of a swarm epoch: warm-up, then constant or decaying to the last epoch.

Keyed on the swarm's epoch (the optimizer's ``local_epoch``, which a newcomer takes from the
state it downloads), never on a volunteer's own step count: every peer, whenever it joined,
steps at the same epoch with the same learning rate. Pure arithmetic, no torch.
"""

from __future__ import annotations

import math

__all__ = ["lr_factor"]


def lr_factor(epoch: int, *, schedule: str, warmup_epochs: int, epochs: int | None) -> float:
    """The factor of the run's ``lr`` at swarm ``epoch``: ``(epoch + 1) / (warmup_epochs + 1)``
    during warm-up (the first epoch does not waste a step at 0); then 1 (``"constant"``), or
    from 1 down to 0 at ``epochs`` along a line (``"linear"``) or a half cosine
    (``"cosine"``, Loshchilov & Hutter, SGDR, 2017)."""
    if epoch < 0:
        raise ValueError(f"epoch: must not be negative, got {epoch}")
    if epoch < warmup_epochs:
        return (epoch + 1) / (warmup_epochs + 1)
    if schedule == "constant":
        return 1.0
    if epochs is None:
        raise ValueError(f"lr_schedule {schedule!r} needs the run's epochs")
    progress = min(1.0, (epoch - warmup_epochs) / max(1, epochs - warmup_epochs))
    if schedule == "linear":
        return 1.0 - progress
    if schedule == "cosine":
        return 0.5 * (1.0 + math.cos(math.pi * progress))
    raise ValueError(f"unknown lr_schedule {schedule!r}")
