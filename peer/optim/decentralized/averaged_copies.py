"""What :class:`peer.optim.DecentralizedOptimizer`'s background rounds average, and how a
round's result reaches the model between two passes.

Parameters are read by the forward and backward passes, which run *outside* the averager's
lock: a round that wrote into them mid-pass would corrupt the gradient (autograd rejects it).
So rounds average a buffer, not the parameters: after every local step (lock held) the
buffer receives a copy of the parameters, and the round's result ``average - (buffer when
the round began)`` is added to the parameters at the next safe point — the next ``step()``
or ``zero_grad()``. Local steps taken while a round runs are kept, as in hivemind.
Gradients (``average_gradients``) go the same way: the buffer receives the latest local
gradients, and the round's correction is added to ``.grad`` once, at the next ``step()``
(a delayed correction; exact only if gradients change slowly). Optimizer statistics are
only touched by the optimizer's own step, under the lock, so rounds average them in place.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["AveragedCopies"]


class AveragedCopies:
    """The tensors a round averages (:attr:`tensors`): copies of ``params`` (if
    ``parameters``), of their gradients (if ``gradients``), then the named per-parameter
    ``statistics`` of ``opt``'s state, in place. Every method runs with the lock held."""

    def __init__(
        self,
        params: Sequence[torch.Tensor],
        opt: torch.optim.Optimizer,
        *,
        parameters: bool,
        gradients: bool,
        statistics: Sequence[str],
    ) -> None:
        self.params = list(params)
        self.tensors: list[torch.Tensor] = []
        # what a round averages (buffer), and its value when last written (written)
        self.param_buffers: list[torch.Tensor] = []
        self.param_written: list[torch.Tensor] = []
        if parameters:
            self.param_buffers = [p.detach().clone() for p in self.params]
            self.param_written = [b.clone() for b in self.param_buffers]
            self.tensors += self.param_buffers
        self.grad_buffers: list[torch.Tensor] = []
        self.grad_written: list[torch.Tensor] = []
        if gradients:
            self.grad_buffers = [
                torch.zeros_like(p, memory_format=torch.contiguous_format) for p in self.params
            ]
            self.grad_written = [torch.zeros_like(b) for b in self.grad_buffers]
            self.tensors += self.grad_buffers
        for name in statistics:
            for p in self.params:
                value = opt.state[p].get(name)
                if not isinstance(value, torch.Tensor):
                    raise ValueError(
                        f"optimizer statistic {name!r} is not a tensor in the state of "
                        f"{type(opt).__name__} (found {type(value).__name__})"
                    )
                self.tensors.append(value)

    def exchange_parameters(self) -> None:
        """Add what finished rounds did to the buffer since the last exchange (``buffer -
        written``: zero if no round finished) to the parameters, then put the parameters in
        the buffer for the next round."""
        if not self.param_buffers:
            return
        params = [p.detach() for p in self.params]
        with torch.no_grad():
            # foreach: one call per operation instead of a Python loop over tensors
            torch._foreach_add_(params, self.param_buffers)
            torch._foreach_sub_(params, self.param_written)
            torch._foreach_copy_(self.param_buffers, params)
            torch._foreach_copy_(self.param_written, params)

    def apply_gradient_correction(self) -> None:
        """Add the last round's correction to ``.grad`` and put the latest local gradients
        where the next round will average them."""
        if not self.grad_buffers:
            return
        with torch.no_grad():
            for p, buffer, written in zip(
                self.params, self.grad_buffers, self.grad_written, strict=True
            ):
                if p.grad is None:
                    continue
                correction = buffer - written  # zero unless a round finished since
                written.copy_(p.grad)
                buffer.copy_(p.grad)
                p.grad.add_(correction)

    def restart_from_parameters(self) -> None:
        """The parameters were replaced (a downloaded state): the next round starts from
        them, and no earlier round's change is added to them."""
        with torch.no_grad():
            for p, buffer, written in zip(
                self.params, self.param_buffers, self.param_written, strict=True
            ):
                buffer.copy_(p)
                written.copy_(p)
