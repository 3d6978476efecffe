"""The collaborative optimizer's gradients between two rounds: accumulated, weighted by the
samples behind them, handed to the gradient round as this peer's mean gradient.

``Σ batch_size · grad`` over a peer's steps, divided by ``Σ batch_size`` before averaging, is
its mean gradient per sample; averaging with weight ``Σ batch_size`` then gives the mean over
every sample the swarm processed. With ``reuse_grad_buffers`` ``.grad`` itself accumulates
(backward adds to it); with ``delay_grad_averaging`` the next epoch accumulates in a second
buffer while a background round averages the first. Training thread only.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import cast

import torch

from peer.averaging.allreduce.partition import zeros_back_to_back
from peer.optim.collaborative.options import CollaborativeOptions

__all__ = ["GradientAccumulator"]


class _ModelGradients:
    """The model's parameters as ``GradScaler.unscale_`` sees an optimizer: with
    ``offload_optimizer`` the wrapped optimizer holds the host-memory copies instead."""

    def __init__(self, params: list[torch.nn.Parameter]) -> None:
        self.param_groups = [{"params": params}]


class GradientAccumulator:
    """The model's gradients summed over steps until the epoch's gradient round.

    ``averaged`` are the gradient averager's tensors (host memory, one flat buffer so that
    in-place rounds average it without a copy); ``acc`` is where steps accumulate: the same
    tensors, or a second buffer with ``delay_grad_averaging``."""

    def __init__(
        self,
        params: list[torch.nn.Parameter],
        options: CollaborativeOptions,
        batch_size_per_step: int | None,
    ) -> None:
        self.params = params
        self.reuse_grad_buffers = options.reuse_grad_buffers
        self.use_local_updates = options.use_local_updates
        self.batch_size_per_step = batch_size_per_step
        self.averaged: list[torch.Tensor] = zeros_back_to_back(params)
        self.acc: list[torch.Tensor] = (
            [torch.zeros_like(g) for g in self.averaged]
            if options.delay_grad_averaging
            else self.averaged
        )
        self.samples = 0  # accumulated at the current epoch
        self.samples_total = 0
        self._model_grads = _ModelGradients(params)

    def unscale(self, grad_scaler: torch.amp.GradScaler) -> bool:
        """Unscale the model's ``.grad`` in place and update the scaler; False if any gradient
        overflowed."""
        grad_scaler.unscale_(cast(torch.optim.Optimizer, self._model_grads))
        finite = all(p.grad is None or bool(torch.isfinite(p.grad).all()) for p in self.params)
        grad_scaler.update()  # lowers the scale after an overflow, raises it after a clean run
        return finite

    def add(self, batch_size: int) -> None:
        """Count this call's ``.grad``, behind ``batch_size`` samples."""
        if not (self.reuse_grad_buffers or self.use_local_updates):
            with torch.no_grad():
                for p, acc in zip(self.params, self.acc, strict=True):
                    if p.grad is not None:
                        acc.add_(p.grad.to(acc.device), alpha=float(batch_size))
        self.samples += batch_size
        self.samples_total += batch_size

    def load_round(self, grads: Sequence[torch.Tensor], weight: float) -> None:
        """This peer's mean gradient into the gradient averager's ``grads`` (its
        ``get_tensors()``, held by the caller); the accumulators are emptied for the next
        epoch. No round is in flight."""
        with torch.no_grad():
            for g, acc, p in zip(grads, self.acc, self.params, strict=True):
                if self.reuse_grad_buffers:
                    # .grad holds the sum of per-step mean gradients, each over batch_size_per_step
                    g.copy_(p.grad if p.grad is not None else torch.zeros_like(p))
                    per_step = float(self.batch_size_per_step or 0)
                    g.mul_(per_step / weight if weight else 0.0)
                elif acc is not g:
                    g.copy_(acc).div_(weight) if weight else g.zero_()
                    acc.zero_()
                elif weight:
                    g.div_(weight)

    def consume_model_gradients(self) -> None:
        """The model's gradients were accumulated before this round: left in ``.grad``, the
        next backward would add to them (the epoch may end in a later ``step()`` call, after
        the user's ``zero_grad()``)."""
        if self.use_local_updates:
            return
        for p in self.params:
            if self.reuse_grad_buffers and p.grad is not None:
                p.grad.zero_()
            else:
                p.grad = None

    def reset(self) -> None:
        """Drop what was accumulated (a downloaded state replaces it)."""
        with torch.no_grad():
            for buffer in (self.acc, self.averaged):
                for g in buffer:
                    g.zero_()
        self.samples = 0
