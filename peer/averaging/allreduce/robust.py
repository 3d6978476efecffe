"""Aggregators that a minority of bad contributions cannot take over, without I/O.

The plain weighted mean (the default) is exact but one sender can move it anywhere. For
open runs a reducer can aggregate each part with a robust rule over all its contributions
(see :class:`~peer.averaging.allreduce.reducer.WeightedMeanReducer`):

* ``trimmed_mean``: per coordinate, drop the ``trim`` largest and smallest values and
  average the rest (weights ignored: a weight is only a claim);
* ``centered_clip``: CenteredClip (Karimireddy, He & Jaggi 2021) from the coordinate-wise
  median; ``tau`` defaults to :data:`CLIP_FACTOR` times the median distance, and a member
  claiming ``k`` times the median weight has its radius divided by ``k``, so no declared
  weight buys more pull. Unclipped honest groups get their exact weighted mean.
* :func:`pair_average` for two members (no majority): their mean only if it moves neither by
  more than :data:`PAIR_RADIUS` of its own norm (checked on receipt by
  :func:`within_pair_radius`). Also :func:`weight_bound` and :func:`outliers`.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

import torch

__all__ = [
    "AGGREGATORS",
    "CLIP_FACTOR",
    "OUTLIER_FACTOR",
    "PAIR_RADIUS",
    "aggregate",
    "centered_clip",
    "check_aggregator",
    "default_trim",
    "median",
    "outliers",
    "pair_average",
    "sort_rows",
    "trimmed_mean",
    "weight_bound",
    "within_pair_radius",
]

#: the aggregators a reducer knows; "mean" is the streamed weighted mean
AGGREGATORS = ("mean", "trimmed_mean", "centered_clip")

CENTERED_CLIP_ITERATIONS = 3
#: CenteredClip's default ``tau``: this many times the median distance to the start
CLIP_FACTOR = 2.0
#: in a pair, the average may move each member by at most this fraction of the norm of its
#: own values (:func:`pair_average`)
PAIR_RADIUS = 0.1
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
    ``v ← v + Σᵢ wᵢ·min(1, τᵢ/‖xᵢ - v‖)·(xᵢ - v) / Σᵢ wᵢ``, ``iterations`` times, from
    ``center`` (default the coordinate-wise :func:`median`). ``tau`` defaults to
    :data:`CLIP_FACTOR` times the median of ``‖xᵢ - center‖``; member ``i``'s radius is
    ``τᵢ = τ · min(1, w_med / wᵢ)`` with ``w_med`` the lower median of the positive weights,
    so no declared weight pulls harder than a median-weight member clipped at ``τ``.
    Returns ``[d]``.

    CenteredClip (Karimireddy, He & Jaggi 2021, "Learning from History for
    Byzantine Robust Optimization"): starting from the coordinate-wise median, move towards
    each contribution by at most ``tau`` (its deviation clipped to that norm), weighted, a few
    iterations. Without ``tau`` it is :data:`CLIP_FACTOR` times the median distance of the
    contributions to the start, so the rule needs no tuning to the scale of the values, and
    honest contributions, which lie at similar distances, are seldom clipped: the aggregate of
    contributions none of which is clipped is their weighted mean exactly (from any start),
    so an honest group pays next to nothing for the protection.

    The paper's rule weighs every worker alike; a weight here is a claim (samples a member
    says it processed), so it may not scale the pull the clip bounds. A member declaring
    ``k`` times the group's (lower) median weight has its clip radius divided by ``k``: its
    pull, ``wᵢ/Σw · min(‖xᵢ - v‖, τᵢ)``, never exceeds ``w_med/Σw · τ``, what a member of
    the median weight can pull, whatever weight it declares (within the run's weight bound).
    Members at or under the median weight are clipped exactly as in the paper, and an honest
    group with different batch sizes keeps its exact weighted mean as long as each heavier
    member lies within ``τ · w_med / wᵢ`` (honest members at similar distances, weights within
    :data:`CLIP_FACTOR` times the median). Capping the weights themselves at the median
    would bound the pull as well but bias every honest group with unequal batches.
    """
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
    positive = sorted(float(x) for x in w if x > 0)
    typical = positive[(len(positive) - 1) // 2]  # the lower median: of two, the lighter
    # a member's radius shrinks as its weight grows past the median: its pull stays bounded
    shrink = (typical / w.clamp_min(typical)).to(values.dtype)  # [n], 1 up to the median
    w = w / total
    v = median(values) if center is None else center.to(values.dtype).clone()
    if tau is None:
        tau = CLIP_FACTOR * float(median((values - v).norm(dim=1).unsqueeze(1)))
    if not tau >= 0 or math.isinf(tau):
        raise ValueError("tau must be finite and non-negative")
    radius = tau * shrink  # [n]
    unclipped = False  # the last update clipped nothing: v is the weighted mean
    for _ in range(iterations):
        deviations = values - v  # [n, d]
        norms = deviations.norm(dim=1)  # [n]
        clipped = norms > radius
        if unclipped and not bool(clipped.any()):
            break  # the weighted mean, and nothing to clip around it: a fixed point
        unclipped = not bool(clipped.any())
        scale = torch.where(clipped, radius / norms.clamp_min(1e-30), torch.ones_like(norms))
        v = v + (deviations * (w * scale).unsqueeze(1)).sum(dim=0)
    return v


def pair_average(
    values: torch.Tensor, weights: Sequence[float] | torch.Tensor
) -> torch.Tensor | None:
    """The weighted mean of two contributions ``values`` ``[2, d]``, or None where it would
    move either of them by more than :data:`PAIR_RADIUS` times the norm of its own values
    (each then keeps its own).

    Two contributions have no majority: CenteredClip from their midpoint never clips (each
    lies at the median distance), so one member of a pair would move the other anywhere.
    With this rule two honest members that roughly agree (parameters of one model, a little
    apart) still converge, while a hostile partner moves an honest member by at most that
    fraction of its own values per round. A member checks that bound on any pair's average
    it receives (:func:`within_pair_radius`), so a hostile reducer cannot bypass it.
    """
    if values.shape[0] != 2:
        raise ValueError("a pair is two contributions")
    w = torch.as_tensor(weights).to(values.dtype)
    mean = (values * w.unsqueeze(1)).sum(dim=0) / w.sum()
    for row in values:
        if not within_pair_radius(mean, row):
            return None
    return mean


def within_pair_radius(average: torch.Tensor, own: torch.Tensor, slack: float = 0.0) -> bool:
    """Does ``average`` lie within :data:`PAIR_RADIUS` (plus a relative ``slack``, for
    rounding on the way) times ``‖own‖`` of ``own``? The bound a member of a pair holds
    any average to."""
    own = own.to(average.dtype)
    radius = PAIR_RADIUS * (1.0 + slack) * float(own.norm())
    return float((average - own).norm()) <= radius


def aggregate(
    name: str, values: torch.Tensor, weights: Sequence[float] | torch.Tensor
) -> torch.Tensor | None:
    """The aggregate of ``values`` ``[n, d]`` by the rule ``name`` (see :data:`AGGREGATORS`),
    with its defaults. Returns ``[d]``, or None for a robust rule over two contributions
    that disagree by more than :func:`pair_average` accepts (each keeps its own values)."""
    if name == "mean":
        w = torch.as_tensor(weights).to(values.dtype)
        return (values * w.unsqueeze(1)).sum(dim=0) / w.sum()
    if name not in AGGREGATORS:
        raise ValueError(f"unknown aggregator {name!r}")
    if values.shape[0] == 2:
        return pair_average(values, weights)
    if name == "trimmed_mean":
        return trimmed_mean(values)
    return centered_clip(values, weights)


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
