"""``HierarchicalModelAverager``: hierarchical SGD over a machine's processes and the swarm.

Same signature and semantics as ``torch.distributed``'s ``HierarchicalModelAverager`` (an
ordered map *period → group size* in processes; ``average_parameters(params)`` after every
optimizer step; nothing averaged during ``warmup_steps``; at a step several periods divide,
only the largest period's level averages), with one more kind of level: one larger than the
local ``torch.distributed`` world averages across the swarm (see the class).
"""

from __future__ import annotations

import logging
import warnings
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping

import torch
import torch.distributed as dist

from peer.formats.open_types import StateDict
from peer.optim.averager_options import AveragerOptions
from peer.optim.hierarchy.levels import (
    LocalWorld,
    SwarmLevel,
    flatten_into,
    params_to_average,
    unflatten_from,
)
from peer.optim.seam import SwarmNode

logger = logging.getLogger("peer.optim.hierarchical")


def _new_subgroups(size: int, group: dist.ProcessGroup | None) -> dist.ProcessGroup:
    """This rank's subgroup when ``group`` is cut into subgroups of ``size`` ranks."""
    # torch leaves new_subgroups unannotated: (this rank's subgroup, every subgroup)
    new_subgroups: Callable[..., tuple[dist.ProcessGroup, list[dist.ProcessGroup]]] = (
        dist.new_subgroups
    )
    return new_subgroups(group_size=size, group=group)[0]


__all__ = ["HierarchicalModelAverager", "period_for_step"]


def period_for_step(step: int, periods: Iterable[int], warmup_steps: int = 0) -> int | None:
    """The period whose level averages at ``step``: the largest that divides it, or ``None``
    (during warm-up, or when none divides it)."""
    if step < warmup_steps:
        return None
    for period in sorted(periods, reverse=True):
        if step % period == 0:
            return period
    return None


class HierarchicalModelAverager:
    """Average parameters at several levels, each with its own period (see the module
    docstring). Call :meth:`average_parameters` after every ``optimizer.step()``.

    A level whose groups fit in the local world (``size <= world``) averages in subgroups of
    it (``new_subgroups``), exactly like the original. A larger one averages across the
    swarm: the local world first averages as a whole, then its leader (rank 0, which holds
    the node) averages with ``size / world`` machines of the swarm — one averager per level,
    under its own key (``{prefix}.p{period}``), weighted by the machine's process count — and
    gives the result back to its local world. The top level's size is the swarm's expected
    size in processes, or ``None`` for everyone online. Without a ``node`` every level must
    fit in the local world, and the last size must be the world's, as in the original. A
    swarm round that forms no group in time is skipped for that step (logged, counted in
    :attr:`skipped`): each machine keeps its local average, and training goes on after at
    most ``averaging_timeout``.

    Swarm options (keyword-only): ``node`` (the :class:`peer.Node`; needed on the local
    world's rank 0 when a level is larger than the local world), ``prefix`` (the key that
    the swarm's averagers share), ``matchmaking_time`` (how long a swarm round gathers its
    group), ``averaging_timeout`` (the most a swarm round may take), ``averager_opts``
    (passed to each :class:`~peer.averaging.DecentralizedAverager`).
    """

    def __init__(
        self,
        period_group_size_dict: Mapping[int, int | None] | None = None,
        warmup_steps: int = 0,
        process_group: dist.ProcessGroup | None = None,
        *,
        node: SwarmNode | None = None,
        prefix: str = "hierarchical",
        matchmaking_time: float = 5.0,
        averaging_timeout: float = 30.0,
        averager_opts: AveragerOptions | None = None,
    ) -> None:
        if not period_group_size_dict:
            raise ValueError("Arg ``period_group_size_dict`` must not be empty.")
        self._periods = list(period_group_size_dict.keys())
        if self._periods[0] <= 0:
            raise ValueError(
                "The minimum period in arg ``period_group_size_dict`` must be a positive value."
            )
        if self._periods[-1] == 1:
            warnings.warn(
                "When the maximum period in arg ``period_group_size_dict`` is 1, "
                "no need to use model averaging because the communication cost "
                "of all-reducing parameters will be no less than the cost of all-reducing "
                "gradients by DistributedDataParallel in the backward pass. Therefore, only "
                "DistributedDataParallel should be used for this case.",
                stacklevel=2,
            )
        self.local = LocalWorld(process_group)
        self.process_group = self.local.group
        sizes = list(period_group_size_dict.values())
        last = sizes[-1]
        world = self.local.size
        # the leader's node decides for its whole local world (a collective, as the
        # subgroups below are)
        swarm = bool(self.local.share(1.0 if node is not None and self.local.is_leader else 0.0))
        if not swarm and last != world:
            raise ValueError(
                f"The last value in arg ``period_group_size_dict`` {last} "
                f"must be equal to the size of arg ``process_group`` {world}."
            )
        if warmup_steps < 0:
            raise ValueError("Arg ``warmup_steps`` must be a non-negative number.")
        self.warmup_steps = warmup_steps
        self.step = 0
        self.node = node
        self.prefix = prefix
        #: period → swarm rounds skipped (no group in time, or the round failed)
        self.skipped: dict[int, int] = {}
        #: period → swarm rounds done
        self.rounds: dict[int, int] = {}
        self.period_process_group_dict: OrderedDict[int, dist.ProcessGroup | None] = OrderedDict()
        self._swarm: dict[int, SwarmLevel | None] = {}
        logger.info("Model averaging hierarchy:")
        for period, size in period_group_size_dict.items():
            logger.info(
                "\tEach group that has %s processes average parameters every %s iterations, "
                "if no higher-level averaging.",
                "all online" if size is None else size,
                period,
            )
            if size is not None and size <= world:
                if size == world:
                    self.period_process_group_dict[period] = self.process_group
                else:
                    self.period_process_group_dict[period] = _new_subgroups(
                        size, self.process_group
                    )
                continue
            if not swarm:
                # What torch's new_subgroups says of such a level, at construction as there:
                # without a node nobody averages beyond the local world.
                raise ValueError(
                    f"The arg 'group_size' ({'all online' if size is None else size}) must not "
                    f"exceed the world size ({world}); a level larger than the local world "
                    "averages across the swarm and needs a node (node=peer.Node(...)) on the "
                    "local world's rank 0"
                )
            if size is not None and size % world:
                raise ValueError(
                    f"A group size larger than the local world ({size}) must be a multiple "
                    f"of its size {world}: the swarm averages whole machines."
                )
            machines = None if size is None else size // world
            self.period_process_group_dict[period] = None
            self._swarm[period] = None
            if self.local.is_leader:
                assert node is not None  # a swarm level: the leader's node made it one
                self._swarm[period] = SwarmLevel(
                    node,
                    f"{prefix}.p{period}",
                    machines,
                    matchmaking_time=matchmaking_time,
                    averaging_timeout=averaging_timeout,
                    weight=world,
                    averager_opts=averager_opts,
                )
            self.skipped[period] = 0
            self.rounds[period] = 0

    def _find_period(self) -> int | None:
        return period_for_step(self.step, self._periods, self.warmup_steps)

    @torch.no_grad()
    def average_parameters(self, params: Iterable[torch.Tensor | StateDict]) -> None:
        """Average a model's parameters or an optimizer's ``param_groups`` if this step's
        level says so; then count the step."""
        period = self._find_period()
        if period is not None:
            tensors = params_to_average(params)
            if tensors:
                self._average(period, tensors)
        self.step += 1

    def _average(self, period: int, tensors: list[torch.Tensor]) -> None:
        dtype = tensors[0].dtype
        for t in tensors[1:]:
            dtype = torch.promote_types(dtype, t.dtype)
        flat = torch.empty(sum(t.numel() for t in tensors), dtype=dtype, device=tensors[0].device)
        flatten_into(flat, tensors)
        if period not in self._swarm:
            group = self.period_process_group_dict[period]
            if group is not None and dist.get_rank(group) < 0:  # this rank is not in it
                return
            if torch.accelerator.is_available():
                torch.accelerator.synchronize()
            self.local.average_(flat, group)
            unflatten_from(flat, tensors)
            return
        self.local.average_(flat)
        level = self._swarm[period]
        ok = 1.0
        if level is not None:  # the leader
            host = flat.to("cpu", dtype=torch.float32)
            size = level.average_(host)
            if size == 0:
                ok = 0.0
            else:
                flat.copy_(host)
        if self.local.size > 1:
            self.local.broadcast_(flat)
            ok = self.local.share(ok)
        if ok:
            self.rounds[period] += 1
        else:
            self.skipped[period] += 1
            logger.info("step %d: the swarm level of period %d was skipped", self.step, period)
        unflatten_from(flat, tensors)

    def shutdown(self) -> None:
        """Stop the swarm levels' averagers (the node stays up)."""
        for level in self._swarm.values():
            if level is not None:
                level.shutdown()

    def __enter__(self) -> HierarchicalModelAverager:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()
