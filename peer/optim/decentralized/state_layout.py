"""A wrapped optimizer's whole state as a newcomer downloads it, and back.

:class:`peer.optim.DecentralizedOptimizer` serves ``(metadata, tensors)``: the parameters,
then every tensor of the optimizer's per-parameter state; the metadata holds the epoch, the
step and a *layout* — per parameter, its state's entries ``[key, is_tensor, value]`` (scalars
travel in the layout itself). :func:`pack_state` builds it, :func:`check_state` refuses one
that does not fit this model (``ValueError``), :func:`load_state` writes it in place.
Pure tensor work: the caller holds the averager's lock.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from peer.formats.open_types import JsonObject

__all__ = ["check_state", "load_state", "pack_state"]

_SCALAR_TYPES = (int, float, bool, type(None))

#: one entry of a parameter's state: ``[key, is_tensor, value]`` (a list: it travels as msgpack)
Entry = list[object]
#: per parameter, its state's entries
Layout = list[list[Entry]]


def pack_state(
    params: Sequence[torch.Tensor], opt: torch.optim.Optimizer, *, epoch: int, step: int
) -> tuple[JsonObject, list[torch.Tensor]]:
    """The parameters and the optimizer's state (tensors not copied), with their layout."""
    tensors = [p.detach() for p in params]
    layout: Layout = []
    for p in params:
        entries: list[Entry] = []
        for key, value in sorted(opt.state[p].items()):
            if isinstance(value, torch.Tensor):
                entries.append([key, True, None])
                tensors.append(value.detach())
            elif isinstance(value, _SCALAR_TYPES):
                entries.append([key, False, value])
        layout.append(entries)
    return {"epoch": epoch, "step": step, "state": layout}, tensors


def check_state(
    params: Sequence[torch.Tensor], epoch: int, metadata: object, tensors: Sequence[torch.Tensor]
) -> Layout:
    """The layout of a downloaded state; ``ValueError`` if it does not fit ``params``."""
    if not isinstance(metadata, dict):
        raise ValueError(f"malformed state (metadata is a {type(metadata).__name__})")
    try:
        layout: Layout = metadata["state"]
        if len(layout) != len(params) or epoch < 0:
            raise ValueError("a different number of parameters")
        n_tensors = len(params) + sum(1 for e in layout for entry in e if entry[1])
        if len(tensors) != n_tensors:
            raise ValueError("tensor count does not match the layout")
        for p, t in zip(params, tensors, strict=False):
            if t.shape != p.shape:
                raise ValueError(f"shape {tuple(t.shape)} where {tuple(p.shape)} expected")
    except (KeyError, TypeError) as exc:
        raise ValueError(f"malformed state ({type(exc).__name__}: {exc})") from exc
    return layout


def load_state(
    params: Sequence[torch.Tensor],
    opt: torch.optim.Optimizer,
    layout: Layout,
    tensors: Sequence[torch.Tensor],
) -> None:
    """Write a checked state into ``params`` and ``opt``'s state. State tensors of the same
    shape are written in place (the averager may hold them); others are replaced."""
    incoming = iter(tensors[len(params) :])
    with torch.no_grad():
        for p, t in zip(params, tensors, strict=False):
            p.copy_(t.to(p.dtype))
        for p, entries in zip(params, layout, strict=True):
            state = opt.state[p]
            for key, is_tensor, value in entries:
                if not is_tensor:
                    state[key] = value
                    continue
                t = next(incoming)
                current = state.get(key)
                if isinstance(current, torch.Tensor) and current.shape == t.shape:
                    current.copy_(t.to(current.dtype))
                else:
                    state[key] = t.clone()
