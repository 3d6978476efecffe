"""Aggregators that a minority of bad contributions cannot take over, without I/O.

The plain weighted mean is the all-reduce's default: fast (streamed into one accumulator as
contributions arrive) and exact, but one sender can move it anywhere. For open runs, where
anyone may join, a reducer can instead aggregate each part with a robust rule over all its
contributions at once (see :class:`~peer.averaging.reducer.WeightedMeanReducer`):

* ``trimmed_mean``: coordinate by coordinate, drop the ``trim`` largest and the ``trim``
  smallest values and average the rest (weights are ignored: a weight is only a claim);
* ``centered_clip``: CenteredClip (Karimireddy, He & Jaggi 2021, "Learning from History for
  Byzantine Robust Optimization"): starting from the coordinate-wise median, move towards
  each contribution by at most ``tau`` (its deviation clipped to that norm), weighted, a few
  iterations. Without ``tau`` it is the median distance of the contributions to the start,
  so the rule needs no tuning to the scale of the values.

Also :func:`weight_bound`: the largest weight a group tolerates relative to its median.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

import torch

__all__ = [
    "AGGREGATORS",
    "aggregate",
    "centered_clip",
    "check_aggregator",
    "default_trim",
    "trimmed_mean",
    "weight_bound",
]

#: the aggregators a reducer knows; "mean" is the streamed weighted mean
AGGREGATORS = ("mean", "trimmed_mean", "centered_clip")

CENTERED_CLIP_ITERATIONS = 3


def check_aggregator(name: str) -> str:
    if name not in AGGREGATORS:
        raise ValueError(f"aggregator must be one of {', '.join(AGGREGATORS)}, not {name!r}")
    return name


def default_trim(n: int) -> int:
    """Values trimmed at each end for ``n`` contributions: a quarter of them (at least one
    from three on), always leaving one in the middle."""
    return min((n - 1) // 2, max(1, n // 4))


def trimmed_mean(values: torch.Tensor, trim: int | None = None) -> torch.Tensor:
    """Coordinate-wise mean of ``values`` ``[n, d]`` without the ``trim`` largest and the
    ``trim`` smallest of each coordinate (default :func:`default_trim`). Returns ``[d]``."""
    n = values.shape[0]
    if n == 0:
        raise ValueError("nothing to aggregate")
    if trim is None:
        trim = default_trim(n)
    if trim < 0 or 2 * trim >= n:
        raise ValueError(f"cannot trim {trim} values at each end of {n}")
    if trim == 0:
        return values.mean(dim=0)
    ordered = values.sort(dim=0).values
    return ordered[trim : n - trim].mean(dim=0)


def centered_clip(
    values: torch.Tensor,
    weights: Sequence[float] | torch.Tensor | None = None,
    tau: float | None = None,
    iterations: int = CENTERED_CLIP_ITERATIONS,
    center: torch.Tensor | None = None,
) -> torch.Tensor:
    """CenteredClip of ``values`` ``[n, d]`` with ``weights`` ``[n]`` (default equal):
    ``v ← v + Σᵢ wᵢ·min(1, τ/‖xᵢ - v‖)·(xᵢ - v) / Σᵢ wᵢ``, ``iterations`` times, from
    ``center`` (default the coordinate-wise median). ``tau`` defaults to the median of
    ``‖xᵢ - center‖``. Returns ``[d]``."""
    n = values.shape[0]
    if n == 0:
        raise ValueError("nothing to aggregate")
    if iterations < 1:
        raise ValueError("iterations must be at least 1")
    w = torch.ones(n, dtype=values.dtype) if weights is None else torch.as_tensor(weights)
    w = w.to(values.dtype)
    if w.shape != (n,) or not bool(torch.isfinite(w).all()) or bool((w < 0).any()):
        raise ValueError("weights must be n finite non-negative numbers")
    total = float(w.sum())
    if total <= 0:
        raise ValueError("weights must not all be 0")
    w = w / total
    v = values.median(dim=0).values if center is None else center.to(values.dtype).clone()
    if tau is None:
        tau = float((values - v).norm(dim=1).median())
    if not tau >= 0 or math.isinf(tau):
        raise ValueError("tau must be finite and non-negative")
    for _ in range(iterations):
        deviations = values - v  # [n, d]
        norms = deviations.norm(dim=1)  # [n]
        scale = torch.where(norms > tau, tau / norms.clamp_min(1e-30), torch.ones_like(norms))
        v = v + (deviations * (w * scale).unsqueeze(1)).sum(dim=0)
    return v


def aggregate(
    name: str, values: torch.Tensor, weights: Sequence[float] | torch.Tensor
) -> torch.Tensor:
    """The aggregate of ``values`` ``[n, d]`` by the rule ``name`` (see :data:`AGGREGATORS`),
    with its defaults. Returns ``[d]``."""
    if name == "mean":
        w = torch.as_tensor(weights).to(values.dtype)
        return (values * w.unsqueeze(1)).sum(dim=0) / w.sum()
    if name == "trimmed_mean":
        return trimmed_mean(values)
    if name == "centered_clip":
        return centered_clip(values, weights)
    raise ValueError(f"unknown aggregator {name!r}")


def weight_bound(declared: Iterable[float], factor: float | None) -> float:
    """The largest weight tolerated in a group whose members declared ``declared``:
    ``factor`` times their median (the lower median of the positive ones, so that of two
    members the heavier cannot set it); infinite without ``factor`` or positive weights."""
    if factor is None:
        return math.inf
    positive = sorted(w for w in declared if w > 0)
    if not positive:
        return math.inf
    return factor * positive[(len(positive) - 1) // 2]
