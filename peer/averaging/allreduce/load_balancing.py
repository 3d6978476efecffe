"""Bandwidth-aware span sizes for butterfly all-reduce (pure; no scipy).

:func:`load_balance` gives each member of a group the number of elements it reduces so that
the slowest member's transfer time is least (slow members may reduce nothing);
:func:`optimal_fractions` is the real-valued optimum behind it (its docstring has the cost
model), :func:`max_transfer_time` the cost of a split and :func:`resolve_bandwidths` fills
in unknown bandwidths.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

__all__ = ["load_balance", "max_transfer_time", "optimal_fractions", "resolve_bandwidths"]


def resolve_bandwidths(bandwidths: Sequence[float | None]) -> list[float]:
    """Replace ``None`` (unknown) by the mean of the known positive bandwidths, else 1.

    ``0`` (client mode, or a peer that must not reduce) stays 0. Negative or non-finite
    values raise ``ValueError``.
    """
    known = []
    for b in bandwidths:
        if b is None:
            continue
        if not math.isfinite(b) or b < 0:
            raise ValueError(f"bandwidth must be finite and non-negative, got {b}")
        if b > 0:
            known.append(float(b))
    default = sum(known) / len(known) if known else 1.0
    return [default if b is None else float(b) for b in bandwidths]


def optimal_fractions(bandwidths: Sequence[float | None]) -> list[float]:
    """Real-valued optimal share ``sᵢ/N`` of each member (sums to 1; 0 for bandwidth 0).

    Cost model
    ----------
    A group of ``n`` members averages a flat vector of ``N`` elements; member ``i`` reduces a
    span of ``sᵢ`` elements (``Σ sᵢ = N``) and has bandwidth ``bᵢ`` (elements per second in each
    direction, full duplex). In a butterfly all-reduce member ``i``

    * uploads its values for the other spans, ``N - sᵢ``, plus the average of its own span to
      the ``n - 1`` others, ``(n - 1)·sᵢ``;
    * downloads the others' values for its span, ``(n - 1)·sᵢ``, plus the averages of the
      other spans, ``N - sᵢ``.

    Both directions carry ``N + (n - 2)·sᵢ`` elements, so member ``i`` needs
    ``tᵢ = (N + (n - 2)·sᵢ) / bᵢ``, and the round takes ``max tᵢ``. (A half-duplex link doubles
    every ``tᵢ``; the optimum is the same.) A member that reduces nothing still moves ``N`` each
    way; that time does not depend on the split, so only reducers enter the optimisation.

    Optimum (water-filling)
    -----------------------
    With ``c = n - 2 > 0``, span ``i`` fits in time ``T`` iff ``sᵢ ≤ (T·bᵢ - N)/c``. The least
    feasible ``T`` solves ``Σᵢ max(0, (T·bᵢ - N)/c) = N``: the left side is continuous and
    increasing in ``T``, linear between consecutive break points ``N/bᵢ``. If the ``k`` fastest
    members are the active ones, ``T = N·(c + k) / Σ_{top k} bᵢ``; the right ``k`` is the first
    for which the next member would get nothing (``T·b_{k+1} ≤ N``). Slow members therefore
    reduce nothing when the others are fast enough — the same answer as the small linear
    programme of hivemind's ``load_balance_peers``, found in ``O(n log n)`` without a solver.
    With ``n ≤ 2`` every split costs the same; spans are then proportional to bandwidth.
    """
    bw = resolve_bandwidths(bandwidths)
    n = len(bw)
    active = sorted((i for i in range(n) if bw[i] > 0), key=lambda i: -bw[i])
    if not active:
        raise ValueError("no member can reduce: every bandwidth is 0 (all in client mode?)")
    fractions = [0.0] * n
    c = n - 2
    if c <= 0:
        total = sum(bw[i] for i in active)
        for i in active:
            fractions[i] = bw[i] / total
        return fractions
    # water-filling over the fastest k members, in units where N = 1
    cumulative = 0.0
    time = 0.0
    k = 0
    for k, i in enumerate(active, start=1):
        cumulative += bw[i]
        time = (c + k) / cumulative
        if k == len(active) or time * bw[active[k]] <= 1.0:
            break
    for i in active[:k]:
        fractions[i] = max(0.0, (time * bw[i] - 1.0) / c)
    total = sum(fractions)  # 1 up to rounding; renormalise so callers can rely on it
    return [f / total for f in fractions]


def _round_spans(fractions: Sequence[float], vector_size: int) -> list[int]:
    """Largest-remainder rounding of ``fractions · vector_size`` to integers summing exactly."""
    quotas = [f * vector_size for f in fractions]
    spans = [math.floor(q) for q in quotas]
    active = [i for i, f in enumerate(fractions) if f > 0]
    remainder = vector_size - sum(spans)
    by_remainder = sorted(active, key=lambda i: (-(quotas[i] - spans[i]), i))
    while remainder > 0:  # normally fewer than len(active) steps; loop guards float error
        for i in by_remainder[:remainder]:
            spans[i] += 1
        remainder = vector_size - sum(spans)
    while remainder < 0:
        largest = max(active, key=lambda i: (spans[i], -i))
        spans[largest] -= 1
        remainder += 1
    return spans


def load_balance(
    vector_size: int, bandwidths: Sequence[float | None], min_vector_size: int = 0
) -> list[int]:
    """Integer span sizes, one per member in group order, summing to ``vector_size``.

    ``bandwidths[i]`` is member ``i``'s bandwidth (``None`` = unknown, see
    :func:`resolve_bandwidths`; ``0`` = reduces nothing). Members with bandwidth 0 get 0; every
    other span is 0 or at least ``min_vector_size`` (unless the whole vector is shorter).
    Raises ``ValueError`` if no member can reduce or an argument is out of range.

    Integer spans come from largest-remainder rounding (they sum to ``N`` exactly, each within
    one element of its real optimum, so ``max tᵢ`` is within ``(n - 2)/min bᵢ`` of the optimum).
    A reducer whose span would be positive but below ``min_vector_size`` is dropped (treated as
    bandwidth 0) and the split recomputed, smallest first, until none is left — but the last
    reducer always stays, so a vector shorter than ``min_vector_size`` goes to the fastest one.
    """
    if vector_size < 0 or min_vector_size < 0:
        raise ValueError("vector_size and min_vector_size must be non-negative")
    bw = resolve_bandwidths(bandwidths)
    if not any(b > 0 for b in bw):
        raise ValueError("no member can reduce: every bandwidth is 0 (all in client mode?)")
    if vector_size == 0:
        return [0] * len(bw)
    while True:
        spans = _round_spans(optimal_fractions(bw), vector_size)
        small = [i for i, s in enumerate(spans) if 0 < s < min_vector_size]
        reducers = sum(1 for s in spans if s > 0)
        if not small or reducers <= 1:
            return spans
        # fold the smallest undersized span into the others, then re-solve exactly
        drop = min(small, key=lambda i: (spans[i], bw[i], i))
        bw[drop] = 0.0


def max_transfer_time(spans: Sequence[int], bandwidths: Sequence[float | None]) -> float:
    """``max tᵢ`` over the reducers (positive span), in :func:`optimal_fractions`'s cost model."""
    bw = resolve_bandwidths(bandwidths)
    n, total = len(spans), sum(spans)
    times = [(total + (n - 2) * s) / bw[i] for i, s in enumerate(spans) if s > 0]
    return max(times, default=0.0)
