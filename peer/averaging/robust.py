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
  iterations. Without ``tau`` it is :data:`CLIP_FACTOR` times the median distance of the
  contributions to the start, so the rule needs no tuning to the scale of the values, and
  honest contributions, which lie at similar distances, are seldom clipped: the aggregate of
  contributions none of which is clipped is their weighted mean exactly (from any start),
  so an honest group pays next to nothing for the protection. Two contributions start from
  their midpoint (the median of an even count is the mean of the middle two) and are never
  clipped: two members cannot tell which of them is wrong.

Also :func:`weight_bound`: the largest weight a group tolerates relative to its median, and
:func:`outliers`: the contributions an aggregate left far behind, for the log.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

import torch

__all__ = [
    "AGGREGATORS",
    "CLIP_FACTOR",
    "OUTLIER_FACTOR",
    "aggregate",
    "centered_clip",
    "check_aggregator",
    "default_trim",
    "median",
    "outliers",
    "sort_rows",
    "trimmed_mean",
    "weight_bound",
]

#: the aggregators a reducer knows; "mean" is the streamed weighted mean
AGGREGATORS = ("mean", "trimmed_mean", "centered_clip")

CENTERED_CLIP_ITERATIONS = 3
#: CenteredClip's default ``tau``: this many times the median distance to the start
CLIP_FACTOR = 2.0
#: a contribution this many times further from the aggregate than the group's median
#: distance (and than the aggregate's norm) is an outlier (:func:`outliers`): named in the log
OUTLIER_FACTOR = 10.0


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
    ordered = sort_rows(values)
    return torch.stack(ordered[trim : n - trim]).mean(dim=0)


def sort_rows(values: torch.Tensor) -> list[torch.Tensor]:
    """The rows of ``values`` ``[n, d]`` sorted coordinate by coordinate: ``n`` tensors
    ``[d]``, the smallest values first. An odd-even transposition network of elementwise
    minima and maxima: for the few rows of a group it is hundreds of times faster than
    ``torch.sort`` along the short dimension (d tiny sorts), and exact."""
    rows = list(values.unbind(0))
    n = len(rows)
    for rnd in range(n):
        for i in range(rnd % 2, n - 1, 2):
            low, high = rows[i], rows[i + 1]
            rows[i], rows[i + 1] = torch.minimum(low, high), torch.maximum(low, high)
    return rows


def median(values: torch.Tensor) -> torch.Tensor:
    """Coordinate-wise median of ``values`` ``[n, d]``; of an even count, the mean of the
    middle two (``torch.median`` takes the lower one, which of two values is their
    minimum). Returns ``[d]``."""
    n = values.shape[0]
    if n == 0:
        raise ValueError("nothing to aggregate")
    if n == 1:
        return values[0].clone()
    rows = sort_rows(values)
    if n % 2:
        return rows[n // 2]
    return (rows[n // 2 - 1] + rows[n // 2]) / 2


def centered_clip(
    values: torch.Tensor,
    weights: Sequence[float] | torch.Tensor | None = None,
    tau: float | None = None,
    iterations: int = CENTERED_CLIP_ITERATIONS,
    center: torch.Tensor | None = None,
) -> torch.Tensor:
    """CenteredClip of ``values`` ``[n, d]`` with ``weights`` ``[n]`` (default equal):
    ``v ← v + Σᵢ wᵢ·min(1, τ/‖xᵢ - v‖)·(xᵢ - v) / Σᵢ wᵢ``, ``iterations`` times, from
    ``center`` (default the coordinate-wise :func:`median`). ``tau`` defaults to
    :data:`CLIP_FACTOR` times the median of ``‖xᵢ - center‖``. Returns ``[d]``."""
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
    v = median(values) if center is None else center.to(values.dtype).clone()
    if tau is None:
        tau = CLIP_FACTOR * float(median((values - v).norm(dim=1).unsqueeze(1)))
    if not tau >= 0 or math.isinf(tau):
        raise ValueError("tau must be finite and non-negative")
    unclipped = False  # the last update clipped nothing: v is the weighted mean
    for _ in range(iterations):
        deviations = values - v  # [n, d]
        norms = deviations.norm(dim=1)  # [n]
        clipped = norms > tau
        if unclipped and not bool(clipped.any()):
            break  # the weighted mean, and nothing to clip around it: a fixed point
        unclipped = not bool(clipped.any())
        scale = torch.where(clipped, tau / norms.clamp_min(1e-30), torch.ones_like(norms))
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


def outliers(values: torch.Tensor, aggregate: torch.Tensor) -> list[tuple[int, float]]:
    """The rows of ``values`` ``[n, d]`` further from ``aggregate`` ``[d]`` than
    :data:`OUTLIER_FACTOR` times the larger of the rows' median distance to it and the
    aggregate's own norm, each with that ratio, furthest first. The norm keeps an honest
    straggler among members holding equal values (median distance 0: a peer one step
    behind the others' model) from being named. Fewer than three rows: none (two cannot
    tell which of them is wrong)."""
    if values.shape[0] < 3:
        return []
    distances = (values - aggregate).norm(dim=1)  # [n]
    scale = max(float(median(distances.unsqueeze(1))), float(aggregate.norm()))
    found = []
    for row, distance in enumerate(distances.tolist()):
        ratio = distance / scale if scale > 0 else (math.inf if distance > 0 else 0.0)
        if ratio > OUTLIER_FACTOR:
            found.append((row, ratio))
    return sorted(found, key=lambda item: -item[1])


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
