"""Who does what in a butterfly round, decided alike by every member before it starts.

From the gathered metadata alone (:class:`~peer.averaging.allreduce.vocabulary.MemberInfo`),
each member computes the same :class:`RoundPlan`: the senders (members not auxiliary), the
weights they declared and the group's bound on them (a member over it is excluded at the
start, and reduces nothing, so that its exclusion costs the others no span at local
values), and the :class:`~peer.averaging.allreduce.partition.Partition` of the flat vector into one
span per member (:func:`~peer.averaging.allreduce.load_balancing.load_balance` over the bandwidths;
client-mode members and ``bandwidth=0`` get none). :func:`make_reducer` then builds this
member's :class:`~peer.averaging.allreduce.reducer.WeightedMeanReducer` over its own span, if it has
one. Pure: no I/O, no clock.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass

import torch

from peer.averaging.allreduce.load_balancing import load_balance
from peer.averaging.allreduce.partition import FlatLayout, Partition
from peer.averaging.allreduce.reducer import WeightedMeanReducer
from peer.averaging.allreduce.robust import weight_bound
from peer.averaging.allreduce.vocabulary import AllreduceConfig, MemberInfo
from peer.compression import Compression, NoCompression, TensorRole

__all__ = ["RoundPlan", "make_reducer", "plan_round"]


@dataclass(frozen=True)
class RoundPlan:
    """The roles and spans of one round (see the module docstring)."""

    senders: list[str]
    # the weights the senders declared in matchmaking, which their parts must carry (empty
    # unless every sender declared one)
    declared: dict[Hashable, float]
    weight_bound: float
    overweight: dict[str, float]  # members that declared a weight over the bound
    partition: Partition
    # per reducer: its parts' element counts, and whether each travels uncompressed
    sizes: list[list[int]]
    plain: list[list[bool]]

    @property
    def weighted_senders(self) -> int:
        """The senders whose values count: not over the bound, weight not 0."""
        return sum(
            1 for s in self.senders if s not in self.overweight and self.declared.get(s, 1.0) > 0
        )


def plan_round(
    me: str,
    members: Sequence[MemberInfo],
    layout: FlatLayout,
    *,
    compression: Compression,
    roles: Sequence[TensorRole] | None,
    config: AllreduceConfig,
) -> RoundPlan:
    """The plan every member of ``members`` computes alike; ``ValueError`` if ``me``
    declared a weight over the group's bound."""
    senders = [m.peer_id for m in members if not m.auxiliary]
    # the weights the senders declared in matchmaking, which their parts must carry, and
    # those over the group's bound (every member computes the same: excluded at start)
    declared: dict[Hashable, float] = {
        m.peer_id: m.weight for m in members if not m.auxiliary and m.weight is not None
    }
    if len(declared) < len(senders):
        declared = {}
    bound = min(config.max_weight, weight_bound(declared.values(), config.relative_weight_bound))
    overweight = {
        m.peer_id: m.weight
        for m in members
        if declared and m.weight is not None and m.weight > bound
    }
    if me in overweight:
        raise ValueError(
            f"this peer's weight {overweight[me]:g} is over the group's bound "
            f"of {bound:g} (max_weight, relative_weight_bound)"
        )
    bandwidths = [0.0 if m.client_mode else m.bandwidth for m in members]
    if any(
        b != 0.0 and m.peer_id not in overweight for b, m in zip(bandwidths, members, strict=True)
    ):
        # an overweight member reduces nothing: every member leaves it out of the
        # partition alike, so its exclusion costs the others no span at local values
        bandwidths = [
            0.0 if m.peer_id in overweight else b for b, m in zip(bandwidths, members, strict=True)
        ]
    spans = load_balance(layout.total, bandwidths, config.min_vector_size)
    partition = Partition(layout, spans, config.part_size_bytes, compression, roles)
    return RoundPlan(
        senders=senders,
        declared=declared,
        weight_bound=bound,
        overweight=overweight,
        partition=partition,
        sizes=[partition.part_sizes(r) for r in range(len(members))],
        plain=[
            [isinstance(p.codec, NoCompression) for p in partition.parts_of(r)]
            for r in range(len(members))
        ],
    )


def make_reducer(
    plan: RoundPlan,
    index: int,
    layout: FlatLayout,
    flat: torch.Tensor,
    *,
    config: AllreduceConfig,
    scratch: Callable[[int, torch.dtype], torch.Tensor] | None,
    in_place: bool,
    alpha: float,
) -> WeightedMeanReducer | None:
    """Member ``index``'s reducer over its span, or None if it reduces nothing (no span,
    or no senders). Its accumulator is ``scratch(numel, dtype)`` when given; with
    ``in_place`` and ``alpha == 1`` in the flat buffer's dtype, averages go straight into
    their slots of ``flat`` (already the result, in place)."""
    my_sizes = plan.sizes[index]
    if not (my_sizes and plan.senders):
        return None
    numel = sum(my_sizes)
    acc_dtype = torch.float32 if layout.dtype in (torch.float16, torch.bfloat16) else layout.dtype
    out = scratch(numel, acc_dtype) if scratch is not None else None
    destination = None
    if in_place and alpha == 1.0 and acc_dtype == layout.dtype:
        # averages go straight into their slots (already the result, in place)
        start, stop = plan.partition.spans[index]
        destination = flat[start:stop]
    return WeightedMeanReducer(
        my_sizes,
        plan.senders,
        dtype=layout.dtype,
        out=out,
        destination=destination,
        max_weight=plan.weight_bound,
        declared=plan.declared or None,
        aggregator=config.aggregator,
    )
