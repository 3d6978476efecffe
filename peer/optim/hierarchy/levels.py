"""The two levels that :class:`~peer.optim.hierarchy.hierarchical.HierarchicalModelAverager` and
:class:`~peer.optim.hierarchy.daso.DASO` average over.

* :class:`LocalWorld` — the processes that share a machine or a cluster: a
  ``torch.distributed`` process group (gloo on CPU, NCCL on GPUs), or this process alone
  when ``torch.distributed`` is not initialised. Its rank 0 is the machine's *leader*: the
  one process that talks to the swarm.
* :class:`SwarmLevel` — machines across the internet: one
  :class:`~peer.averaging.DecentralizedAverager` over a flat buffer, created on first use
  (the shapes are known only then), under its own key, so groups form among whoever is
  online. A round that cannot form a group or fails is *skipped*: logged, counted, and the
  caller keeps its own values. It never blocks longer than ``averaging_timeout``.

Parameters travel as one flat buffer: :func:`flatten_into` and :func:`unflatten_from` copy
between a list of tensors (any dtypes, any devices) and it.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping, Sequence

import torch
import torch.distributed as dist

from peer.averaging.averager import DecentralizedAverager
from peer.averaging.control import StepControl
from peer.averaging.exceptions import StepFailed
from peer.formats.open_types import StateDict
from peer.optim.averager_options import AveragerOptions
from peer.optim.seam import SwarmNode

logger = logging.getLogger("peer.optim.levels")

__all__ = ["LocalWorld", "SwarmLevel", "flatten_into", "params_to_average", "unflatten_from"]


def params_to_average(params: Iterable[torch.Tensor | StateDict]) -> list[torch.Tensor]:
    """The tensors to average from a model's parameters or an optimizer's ``param_groups``:
    those that have a gradient (as ``torch.distributed``'s model averagers choose them)."""
    chosen: list[torch.Tensor] = []
    for item in params:
        if isinstance(item, torch.Tensor):
            if item.grad is not None:
                chosen.append(item)
        elif isinstance(item, Mapping) and "params" in item:
            chosen.extend(p for p in item["params"] if p.grad is not None)
        else:
            raise TypeError(
                f"expected tensors or param_groups (dicts with 'params'), got {type(item).__name__}"
            )
    return chosen


def flatten_into(flat: torch.Tensor, tensors: Sequence[torch.Tensor]) -> None:
    """Copy ``tensors`` back to back into ``flat`` (casting to its dtype and device)."""
    offset = 0
    for t in tensors:
        n = t.numel()
        flat[offset : offset + n].copy_(t.detach().reshape(-1), non_blocking=True)
        offset += n
    if offset != flat.numel():
        raise ValueError(f"the tensors hold {offset} elements, the buffer {flat.numel()}")


@torch.no_grad()
def unflatten_from(flat: torch.Tensor, tensors: Sequence[torch.Tensor]) -> None:
    """Copy ``flat`` back into ``tensors`` in place (each keeps its dtype and device)."""
    offset = 0
    for t in tensors:
        n = t.numel()
        t.copy_(flat[offset : offset + n].view(t.shape), non_blocking=True)
        offset += n


class LocalWorld:
    """The processes of one machine (or cluster): a ``torch.distributed`` group, or this
    process alone when ``torch.distributed`` is not initialised."""

    def __init__(self, process_group: dist.ProcessGroup | None = None) -> None:
        initialised = dist.is_available() and dist.is_initialized()
        if not initialised:
            if process_group is not None:
                raise ValueError("a process_group needs torch.distributed to be initialised")
            self.group: dist.ProcessGroup | None = None
            self.size = 1
            self.rank = 0
            self.leader = 0
            return
        group = process_group if process_group is not None else dist.group.WORLD
        assert group is not None  # (the default group exists once torch.distributed is up)
        self.group = group
        self.size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        # the global rank of the group's rank 0, for broadcast
        self.leader = dist.get_global_rank(group, 0) if self.size > 1 else dist.get_rank()

    @property
    def is_leader(self) -> bool:
        return self.rank == 0

    def average_(self, flat: torch.Tensor, group: dist.ProcessGroup | None = None) -> None:
        """Average ``flat`` in place over ``group`` (default: the whole local world)."""
        group = self.group if group is None else group
        size = 1 if group is None else dist.get_world_size(group)
        if size <= 1:
            return
        if flat.dtype in (torch.float16, torch.bfloat16) and flat.device.type == "cpu":
            wide = flat.float()  # gloo sums reduced precision poorly on CPU
            dist.all_reduce(wide, group=group)
            flat.copy_(wide / size)
            return
        flat /= size
        dist.all_reduce(flat, group=group)

    def broadcast_(self, tensor: torch.Tensor) -> None:
        """Give every process the leader's ``tensor``."""
        if self.size > 1:
            dist.broadcast(tensor, self.leader, group=self.group)

    def mean(self, value: float) -> float:
        """The mean of a number over the local world."""
        if self.size <= 1:
            return float(value)
        t = torch.tensor([float(value)], dtype=torch.float64)
        dist.all_reduce(t, group=self.group)
        return float(t) / self.size

    def share(self, value: float) -> float:
        """The leader's number, on every process."""
        if self.size <= 1:
            return float(value)
        t = torch.tensor([float(value)], dtype=torch.float64)
        self.broadcast_(t)
        return float(t)


class SwarmLevel:
    """One level across the swarm: average a flat buffer with whoever is online.

    ``target_group_size`` is the number of *machines* per group (``None``: everyone online);
    ``weight`` is this machine's weight (its number of processes). ``chunk_numel`` splits
    the buffer into tensors of at most that many elements (they travel as separate parts).
    ``averager_opts`` go to :class:`~peer.averaging.DecentralizedAverager` unchanged.
    """

    def __init__(
        self,
        node: SwarmNode,
        prefix: str,
        target_group_size: int | None,
        *,
        matchmaking_time: float,
        averaging_timeout: float,
        weight: float = 1.0,
        dtype: torch.dtype = torch.float32,
        chunk_numel: int | None = None,
        averager_opts: AveragerOptions | None = None,
    ) -> None:
        if matchmaking_time <= 0 or averaging_timeout <= 0:
            raise ValueError("matchmaking_time and averaging_timeout must be positive")
        self.node = node
        self.prefix = prefix
        self.target_group_size = target_group_size
        self.matchmaking_time = float(matchmaking_time)
        self.averaging_timeout = float(averaging_timeout)
        self.weight = float(weight)
        self.dtype = dtype
        self.chunk_numel = chunk_numel
        self.averager_opts: AveragerOptions = {**(averager_opts or {})}
        self.averager: DecentralizedAverager | None = None
        self.buffer: torch.Tensor | None = None
        self.rounds_done = 0
        self.rounds_skipped = 0
        self.last_group_size = 0

    def _ensure(self, numel: int) -> torch.Tensor:
        if self.buffer is not None:
            if self.buffer.numel() != numel:
                raise ValueError(
                    f"the averaged parameters changed size ({self.buffer.numel()} -> {numel})"
                )
            return self.buffer
        buffer = torch.zeros(numel, dtype=self.dtype)
        step = self.chunk_numel or max(numel, 1)
        chunks = [buffer[i : i + step] for i in range(0, numel, step)] or [buffer]
        opts: AveragerOptions = {
            "target_group_size": self.target_group_size,
            "min_group_size": 2,
            "min_matchmaking_time": self.matchmaking_time,
            "next_chunk_timeout": min(10.0, self.averaging_timeout),
        }
        if self.chunk_numel is not None:
            # parts on the wire of at most one chunk
            part_bytes = self.chunk_numel * buffer.element_size()
            opts["part_size_bytes"] = min(2**19, part_bytes)
        opts.update(self.averager_opts)
        self.averager = DecentralizedAverager(
            chunks, self.node, start=True, prefix=self.prefix, **opts
        )
        self.buffer = buffer
        return buffer

    def begin(self, values: torch.Tensor) -> StepControl:
        """Start a round on a copy of ``values`` (flat); training may go on meanwhile."""
        buffer = self._ensure(values.numel())
        assert self.averager is not None
        with self.averager.get_tensors():
            buffer.copy_(values.reshape(-1))
        control = self.averager.step(weight=self.weight, timeout=self.averaging_timeout, wait=False)
        assert isinstance(control, StepControl)
        return control

    def finish(self, control: StepControl, out: torch.Tensor | None = None) -> int:
        """Wait for a round begun by :meth:`begin`. Returns the group's size and copies the
        average into ``out`` (flat); returns 0 and leaves ``out`` alone if it was skipped."""
        try:
            gathered = control.result(timeout=self.averaging_timeout + self.matchmaking_time)
        except (StepFailed, TimeoutError) as exc:
            control.cancel()
            self.rounds_skipped += 1
            logger.info("%s: round skipped (%s)", self.prefix, exc or type(exc).__name__)
            return 0
        assert self.averager is not None and self.buffer is not None
        self.rounds_done += 1
        self.last_group_size = len(gathered)
        if out is not None:
            with self.averager.get_tensors():
                out.copy_(self.buffer.view(out.shape))
        return self.last_group_size

    def average_(self, values: torch.Tensor) -> int:
        """Average ``values`` (flat) in place; see :meth:`finish`."""
        return self.finish(self.begin(values), out=values)

    def shutdown(self) -> None:
        if self.averager is not None:
            self.averager.shutdown()
