"""An optimizer's state as averaging sees it: created up front, served to newcomers.

* :func:`initialize_optimizer_state` makes an optimizer create its lazily built state (e.g.
  Adam's moments) now, so the set of tensors is fixed for averaging and state download, and
  leaves the optimizer as if it had never stepped.
* :class:`StateSharingAverager` is an averager that serves a caller-defined state (parameters,
  optimizer state, epoch) to peers that download it. Both optimizers use it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from peer.averaging.averager import DecentralizedAverager
from peer.optim.seam import SwarmNode

__all__ = ["StateSharingAverager", "initialize_optimizer_state"]


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
        state_fn: Callable[[], tuple[Any, Sequence[torch.Tensor]]],
        **kwargs: Any,
    ) -> None:
        self._state_fn = state_fn  # set first: start=True may serve state at once
        super().__init__(tensors, node, **kwargs)

    def get_current_state(self) -> tuple[Any, Sequence[torch.Tensor]]:
        return self._state_fn()
