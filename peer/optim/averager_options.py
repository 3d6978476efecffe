"""The keyword options an optimizer passes on to its averagers, typed.

Each is a set of :class:`~peer.averaging.DecentralizedAverager`'s keyword arguments, with the
averager's names and meanings; they differ only in which keys the optimizer sets itself:

* :class:`SharedAveragerOptions` — ``averager_opts=`` of :class:`peer.Optimizer` and
  :class:`peer.DiLoCo` (they set compression, mode and state sharing);
* :class:`PeerAveragerOptions` — the extra keyword arguments of
  :class:`peer.optim.DecentralizedOptimizer` (it sets the group size);
* :class:`AveragerOptions` — every keyword but ``start`` and ``prefix``: ``averager_opts=``
  of DASO, :class:`peer.optim.HierarchicalModelAverager` and the swarm level.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypedDict

from peer.compression import Compression, CompressionInfo

__all__ = [
    "AveragerOptions",
    "PeerAveragerOptions",
    "RoundOptions",
    "SharedAveragerOptions",
    "StateAveragerOptions",
]


class RoundOptions(TypedDict, total=False):
    """How the averager's rounds find a group and run: what every optimizer passes on."""

    min_group_size: int
    initial_group_bits: str
    min_matchmaking_time: float
    request_timeout: float
    averaging_alpha: float
    part_size_bytes: int
    allreduce_timeout: float | None
    next_chunk_timeout: float | None
    sender_timeout: float | None
    reducer_timeout: float | None
    tensor_infos: Sequence[CompressionInfo] | None
    bandwidth: float | None
    min_vector_size: int
    declare_state_period: float
    shutdown_timeout: float
    max_weight: float
    relative_weight_bound: float | None
    aggregator: str


class SharedAveragerOptions(RoundOptions, total=False):
    """``averager_opts=`` of :class:`peer.Optimizer` and :class:`peer.DiLoCo`."""

    target_group_size: int | None


class PeerAveragerOptions(RoundOptions, total=False):
    """The extra keyword arguments of :class:`peer.optim.DecentralizedOptimizer`."""

    compression: Compression
    state_compression: Compression
    auxiliary: bool
    allow_state_sharing: bool | None
    client_mode: bool | None


class StateAveragerOptions(SharedAveragerOptions, PeerAveragerOptions, total=False):
    """Every keyword but ``start``, ``prefix`` and ``concurrent_updates``: what
    :class:`~peer.optim.shared.optimizer_state.SharedLiveState` passes on to its averager."""


class AveragerOptions(StateAveragerOptions, total=False):
    """Every keyword of the averager but ``start`` and ``prefix``."""

    concurrent_updates: bool
