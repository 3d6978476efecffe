"""An optimizer's state as averaging sees it: created up front, served to newcomers.

* :func:`initialize_optimizer_state` makes an optimizer create its lazily built state (e.g.
  Adam's moments) now, so the set of tensors is fixed for averaging and state download, and
  leaves the optimizer as if it had never stepped.
* :class:`StateSharingAverager` is an averager that serves a caller-defined state (parameters,
  optimizer state, epoch) to peers that download it. Both optimizers use it.
* :class:`SharedLiveState` is a :class:`~peer.optim.shared.live_state.LiveState` served that way:
  the averager's lock guards it, and the epoch it belongs to is the averager's sharing
  priority, so newcomers download the newest state rather than a straggler's.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Unpack

import torch

from peer.averaging.averager import DecentralizedAverager
from peer.formats.open_types import JsonObject
from peer.optim.averager_options import AveragerOptions, StateAveragerOptions
from peer.optim.seam import SwarmNode

if TYPE_CHECKING:  # (live_state imports this module)
    from peer.optim.shared.live_state import LiveState

__all__ = ["SharedLiveState", "StateSharingAverager", "initialize_optimizer_state"]


def initialize_optimizer_state(opt: torch.optim.Optimizer) -> None:
    """One step on zero gradients with learning rate 0, then parameters and gradients put
    back and every state tensor and counter zeroed. For SGD (momentum buffer 0) and
    Adam-style optimizers (moments 0, step count 0) the first real step then behaves exactly
    as on a fresh optimizer."""
    params = [p for g in opt.param_groups for p in g["params"]]
    with torch.no_grad():
        saved = [p.detach().clone() for p in params]
        grads = [p.grad for p in params]
        rates = [g.get("lr") for g in opt.param_groups]
        for p in params:
            p.grad = torch.zeros_like(p)
        for group in opt.param_groups:
            if isinstance(group.get("lr"), float | int):
                group["lr"] = 0.0
        try:
            opt.step()
        finally:
            for group, lr in zip(opt.param_groups, rates, strict=True):
                if lr is not None:
                    group["lr"] = lr
            for p, value, grad in zip(params, saved, grads, strict=True):
                p.copy_(value)
                p.grad = grad
        for state in opt.state.values():
            for key, value in list(state.items()):
                if isinstance(value, torch.Tensor):
                    value.zero_()
                elif isinstance(value, int | float) and not isinstance(value, bool):
                    state[key] = type(value)(0)


class StateSharingAverager(DecentralizedAverager):
    """A :class:`DecentralizedAverager` whose state for newcomers is ``state_fn()``:
    ``(metadata, tensors)``, called on the node's loop with the averager's lock held."""

    def __init__(
        self,
        tensors: Sequence[torch.Tensor],
        node: SwarmNode,
        state_fn: Callable[[], tuple[JsonObject, Sequence[torch.Tensor]]],
        *,
        start: bool,
        prefix: str,
        **kwargs: Unpack[AveragerOptions],
    ) -> None:
        self._state_fn = state_fn  # set first: start=True may serve state at once
        super().__init__(tensors, node, start=start, prefix=prefix, **kwargs)

    def get_current_state(self) -> tuple[JsonObject, Sequence[torch.Tensor]]:
        return self._state_fn()

    def refused_state_donors(self) -> frozenset[str]:
        """The donors whose states this peer dropped (:mod:`peer.averaging.sharing.witnesses`)."""
        return self.sharing.refused_donors()


class SharedLiveState:
    """``live`` served to newcomers by its own :class:`StateSharingAverager` (built here with
    ``averager_kwargs``; its rounds average the live state's tensors too). The averager's
    lock, :meth:`lock`, guards the live state: every read and write of it takes the lock,
    which the averager's snapshots for newcomers also take, so nobody reads it half-updated
    (a round does not hold it while it runs: ``concurrent_updates``)."""

    def __init__(
        self,
        live: LiveState,
        node: SwarmNode,
        *,
        start: bool,
        prefix: str,
        **averager_kwargs: Unpack[StateAveragerOptions],
    ) -> None:
        self.live = live
        self.averager = StateSharingAverager(
            [t.detach().clone() for t in live.tensors()],
            node,
            self.snapshot,
            start=start,
            prefix=prefix,
            concurrent_updates=True,
            **averager_kwargs,
        )

    def lock(self) -> contextlib.AbstractContextManager[Sequence[torch.Tensor]]:
        return self.averager.get_tensors()

    def snapshot(self) -> tuple[JsonObject, list[torch.Tensor]]:
        """What a newcomer downloads: the epoch and a copy of the tensors (the averager
        calls it with the lock held)."""
        with torch.no_grad():
            tensors = [t.detach().clone() for t in self.live.tensors()]
        return {"epoch": self.live.epoch}, tensors

    def set_epoch(self, epoch: int) -> None:
        """The live state now belongs to ``epoch``, which is also its sharing priority
        (hivemind does the same). Lock held; any thread."""
        self.live.epoch = epoch
        self.averager.state_sharing_priority = float(epoch)

    def move_to(self, epoch: int, step_scheduler: Callable[[], None]) -> None:
        """Move the live state to a later ``epoch`` (catching up), calling
        ``step_scheduler`` once per epoch passed. Lock held."""
        with warnings.catch_warnings():
            # epochs can pass before this peer's first optimizer step (a newcomer catching
            # up): that is the intended order here, not the mistake torch warns about
            warnings.filterwarnings("ignore", message=r"Detected call of `lr_scheduler\.step\(\)`")
            for _ in range(epoch - self.live.epoch):
                step_scheduler()
        self.set_epoch(epoch)
