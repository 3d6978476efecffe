"""The collaborative optimizer's live state: the tensors its wrapped optimizer steps (the
model's parameters, or host-memory copies of them with ``offload_optimizer``) and the
optimizer's state, as one list of tensors that rounds average and newcomers download.

Not thread-safe by itself: :class:`peer.Optimizer` reads and writes it under the state
averager's lock (see "Locking" in :mod:`peer.optim.collaborative.optimizer`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import cast

import torch
from torch.optim.optimizer import ParamsT

from peer.formats.open_types import StateDict
from peer.optim.buffers import ModelBuffers
from peer.optim.shared.optimizer_state import initialize_optimizer_state

__all__ = ["LiveState", "OptimizerFactory"]

#: builds the wrapped optimizer on the parameters (or parameter groups) it is given
OptimizerFactory = Callable[[ParamsT], torch.optim.Optimizer]


class LiveState:
    def __init__(
        self,
        optimizer: torch.optim.Optimizer | OptimizerFactory,
        params: ParamsT | None,
        *,
        offload: bool,
        buffers: ModelBuffers | None = None,
    ) -> None:
        self.offload = offload
        # the model's buffers, whose shared values travel after the optimizer's tensors
        self.buffers = buffers if buffers is not None else ModelBuffers(None)
        self.opt, self.model_params = self._build(optimizer, params)
        if not self.model_params:
            raise ValueError("the optimizer has no parameters")
        # the tensors the wrapped optimizer steps: host-memory copies with offload
        self.opt_params: list[torch.Tensor] = [
            p for g in self.opt.param_groups for p in g["params"]
        ]
        self.version = 0  # bumped by every write outside a state round
        self.epoch = 0  # the epoch the state belongs to (behind while a step is pending)
        initialize_optimizer_state(self.opt)

    def _build(
        self, optimizer: torch.optim.Optimizer | OptimizerFactory, params: ParamsT | None
    ) -> tuple[torch.optim.Optimizer, list[torch.nn.Parameter]]:
        """The wrapped optimizer and the model's parameters, in the optimizer's order."""
        if isinstance(optimizer, torch.optim.Optimizer):
            if params is not None:
                raise ValueError(
                    "params= is only for an optimizer factory; this optimizer already has its params"
                )
            return optimizer, [p for g in optimizer.param_groups for p in g["params"]]
        if params is None:
            raise ValueError("pass params= when optimizer is a factory")
        given = list(params)
        if not self.offload:
            # (mypy joins the list's items to object: they are params' own)
            opt = optimizer(cast(ParamsT, given))
            return opt, [p for g in opt.param_groups for p in g["params"]]
        dicts = [g for g in given if isinstance(g, dict)]
        groups: list[StateDict]
        if len(dicts) == len(given):
            groups = [dict(g, params=list(g["params"])) for g in dicts]
        else:
            groups = [{"params": given}]
        model = [p for g in groups for p in g["params"]]
        copies = {
            id(p): torch.nn.Parameter(p.detach().to("cpu", copy=True), p.requires_grad)
            for p in model
        }
        opt = optimizer([dict(g, params=[copies[id(p)] for p in g["params"]]) for g in groups])
        offloaded = [p for g in opt.param_groups for p in g["params"]]
        if [id(p) for p in offloaded] != [id(copies[id(p)]) for p in model]:
            raise ValueError("the optimizer factory must keep the parameters it is given, in order")
        return opt, model

    def tensors(self) -> list[torch.Tensor]:
        """The optimizer's parameters, then every optimizer state tensor in a fixed order
        (integer ones, e.g. a step count, as float copies), then the shared values of the
        model's buffers (:mod:`peer.optim.buffers`)."""
        tensors: list[torch.Tensor] = [p.data for p in self.opt_params]
        for p in self.opt_params:
            state = self.opt.state.get(p, {})
            for key in sorted(state):
                value = state[key]
                if isinstance(value, torch.Tensor):
                    tensors.append(value if value.is_floating_point() else value.float())
        tensors += self.buffers.shared
        return tensors

    def load(self, tensors: Sequence[torch.Tensor]) -> None:
        """Write ``tensors`` (as :meth:`tensors` lists them), then the model's parameters and
        buffers; ``ValueError`` if they do not fit this model and optimizer. Training
        thread."""
        own = self.tensors()
        if len(own) != len(tensors) or any(
            a.shape != b.shape for a, b in zip(own, tensors, strict=True)
        ):
            raise ValueError("the downloaded state does not match this model and optimizer")
        with torch.no_grad():
            for p, t in zip(self.opt_params, tensors, strict=False):
                p.copy_(t)
            i = len(self.opt_params)
            for p in self.opt_params:
                state = self.opt.state.get(p, {})
                for key in sorted(state):
                    value = state[key]
                    if isinstance(value, torch.Tensor):
                        value.copy_(tensors[i].to(value.dtype))
                        i += 1
            for b, t in zip(self.buffers.shared, tensors[i:], strict=True):
                b.copy_(t)
        self.version += 1
        self.buffers.write()  # (training thread: forward passes write the buffers)
        self.copy_to_model()

    def copy_from_model(self) -> None:
        """Model parameters → offloaded parameters, after the model's were loaded (training
        thread only)."""
        if not self.offload:
            return
        with torch.no_grad():
            for p, op in zip(self.model_params, self.opt_params, strict=True):
                op.copy_(p.detach().to(op.device, op.dtype))
        self.version += 1

    def copy_to_model(self) -> None:
        """Offloaded parameters → model parameters (training thread only)."""
        if not self.offload:
            return
        with torch.no_grad():
            for p, op in zip(self.model_params, self.opt_params, strict=True):
                p.copy_(op.to(p.device))

    def set_grads(self, grads: Sequence[torch.Tensor | None]) -> None:
        """Put ``grads`` in the optimizer's parameters' ``.grad`` (its own buffers with
        offload; fresh tensors otherwise, as the user's backward would add to anything left
        there)."""
        with torch.no_grad():
            for op, g in zip(self.opt_params, grads, strict=True):
                if g is None:
                    op.grad = None
                elif self.offload and op.grad is not None:
                    op.grad.copy_(g)
                else:
                    op.grad = g.to(op.device, copy=True)
