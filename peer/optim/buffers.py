"""A model's buffers as the swarm optimizers share them.

Buffers are values, not gradients (batch-norm running statistics, step counts): peers that
kept their own would evaluate the swarm's parameters differently, so the optimizers carry
them with their state. :func:`model_buffers` picks them from a model (persistent, not
boolean); :class:`ModelBuffers` holds them and their *shared* values, host ``float32``
copies listed after the optimizer's own tensors, so state rounds average them by the run's
aggregator and newcomers download them, with no change to the averaging protocol. Integer
buffers are written back rounded, in their own dtype, so every member of an exact round ends
with the same count.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch

__all__ = ["ModelBuffers", "model_buffers"]


def model_buffers(model: torch.nn.Module) -> list[torch.Tensor]:
    """The buffers of ``model`` that the swarm shares: persistent (in ``state_dict()``),
    numeric (not ``bool``), each once, in ``state_dict()`` order."""
    persistent = set(model.state_dict(keep_vars=True))
    found: list[torch.Tensor] = []
    seen: set[int] = set()
    for name, buffer in model.named_buffers(remove_duplicate=False):
        if name not in persistent or buffer.dtype == torch.bool or id(buffer) in seen:
            continue
        if buffer.is_complex():
            raise TypeError(f"buffer {name!r}: complex buffers cannot be averaged")
        seen.add(id(buffer))
        found.append(buffer)
    return found


class ModelBuffers:
    """The model's ``buffers`` and their shared values (see the module docstring).

    Only the training thread calls :meth:`read` and :meth:`write` (forward passes write the
    buffers); the shared values are guarded by the owning optimizer's live-state lock."""

    def __init__(self, buffers: Iterable[torch.Tensor] | None) -> None:
        self.model: list[torch.Tensor] = []
        seen: set[int] = set()
        for b in buffers or ():
            if not isinstance(b, torch.Tensor):
                raise TypeError("buffers must be tensors (pass peer.optim.model_buffers(model))")
            if b.dtype == torch.bool or b.is_complex():
                raise TypeError(f"a {b.dtype} buffer cannot be averaged")
            if id(b) not in seen:
                seen.add(id(b))
                self.model.append(b)
        self.shared: list[torch.Tensor] = [
            b.detach().to("cpu", torch.float32, copy=True) for b in self.model
        ]

    def __len__(self) -> int:
        return len(self.model)

    def read(self, into: Sequence[torch.Tensor] | None = None) -> None:
        """The model's buffers now → ``into`` (default: the shared values)."""
        targets = self.shared if into is None else into
        with torch.no_grad():
            for t, b in zip(targets, self.model, strict=True):
                t.copy_(b.detach())

    def write(self, values: Sequence[torch.Tensor] | None = None) -> None:
        """``values`` (default: the shared values) → the model's buffers, integer ones
        rounded to the nearest integer, each in its own dtype and device."""
        sources = self.shared if values is None else values
        with torch.no_grad():
            for b, v in zip(self.model, sources, strict=True):
                if b.is_floating_point():
                    b.copy_(v)
                else:
                    b.copy_(torch.round(v.to(torch.float64)))

    def state_values(self) -> list[torch.Tensor]:
        """The shared values in the buffers' own dtypes (integers rounded), on the CPU:
        what a checkpoint holds."""
        out: list[torch.Tensor] = []
        for b, v in zip(self.model, self.shared, strict=True):
            value = v if b.is_floating_point() else torch.round(v.to(torch.float64))
            out.append(value.to(b.dtype, copy=True))
        return out
