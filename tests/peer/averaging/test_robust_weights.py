"""What a declared weight and a pair can do to a robust aggregate (pure functions and the
reducer, no I/O): a weight does not scale a member's CenteredClip pull, an honest group
with unequal batches keeps its weighted mean, and a pair averages only where neither
member moves by more than :data:`~peer.averaging.allreduce.robust.PAIR_RADIUS` of its own values."""

from __future__ import annotations

import pytest
import torch

from peer.averaging.allreduce.reducer import WeightedMeanReducer
from peer.averaging.allreduce.results import check_pair
from peer.averaging.allreduce.robust import (
    PAIR_RADIUS,
    aggregate,
    centered_clip,
    pair_average,
    within_pair_radius,
)


def test_a_declared_weight_does_not_scale_a_members_pull() -> None:
    """Honest members at 1 and 2, a member at 7: whatever weight it declares (16 times
    the median is a run's bound) it moves the result no further than with the median
    weight; before the radius shrank with the weight, 15 moved it to 6.56."""
    values = torch.tensor([[1.0], [2.0], [7.0]])
    at_median = float(centered_clip(values, [1.0, 1.0, 1.0]))
    for weight in (1.0, 2.0, 4.0, 15.0, 16.0):
        result = float(centered_clip(values, [1.0, 1.0, weight]))
        assert result <= at_median + 1e-6, (weight, result, at_median)
    assert at_median < 2.5  # within the clip of the paper's unweighted rule


def test_a_heavy_members_pull_is_bounded_by_a_median_members_clipped_pull() -> None:
    """One iteration from a given start: a member of weight ``k`` times the median pulls
    by at most ``w_med · τ / Σw``, whatever its distance."""
    g = torch.Generator().manual_seed(0)
    honest = torch.randn(4, 100, generator=g, dtype=torch.float64)
    far = torch.full((1, 100), 1e6, dtype=torch.float64)
    values = torch.cat([honest, far])
    start = torch.zeros(100, dtype=torch.float64)
    tau = 1.0
    weights = [1.0, 1.0, 1.0, 1.0, 16.0]
    with_far = centered_clip(values, weights, tau=tau, iterations=1, center=start)
    without = centered_clip(
        torch.cat([honest, start.unsqueeze(0)]), weights, tau=tau, iterations=1, center=start
    )
    pull = float((with_far - without).norm())
    assert pull <= 1.0 * tau / sum(weights) + 1e-12, pull


def test_an_honest_group_with_unequal_batches_keeps_its_weighted_mean() -> None:
    """Members at similar distances with weights up to twice the median: none is clipped
    (the heavier within ``τ · w_med / w``), and the aggregate is their weighted mean."""
    g = torch.Generator().manual_seed(1)
    for n in (3, 4, 6):
        values = torch.randn(n, 2000, generator=g, dtype=torch.float64)
        weights = torch.linspace(1.0, 2.0, n, dtype=torch.float64)
        mean = (values * weights.unsqueeze(1)).sum(0) / weights.sum()
        assert torch.allclose(centered_clip(values, weights), mean, atol=1e-12), n
        assert torch.allclose(aggregate("centered_clip", values, weights), mean, atol=1e-12)


def test_a_pair_averages_only_within_each_members_radius() -> None:
    model = torch.linspace(-1.0, 1.0, 1000, dtype=torch.float64)
    g = torch.Generator().manual_seed(2)
    near = model + 0.01 * torch.randn(1000, generator=g, dtype=torch.float64)
    pair = torch.stack([model, near])
    mean = (2 * model + near) / 3
    for name in ("centered_clip", "trimmed_mean"):
        out = aggregate(name, pair, [2.0, 1.0])
        assert out is not None and torch.allclose(out, mean), name
        # a partner far away: nobody moves (each keeps its own values)
        apart = torch.stack([model, torch.full_like(model, -1000.0)])
        assert aggregate(name, apart, [1.0, 15.0]) is None
    # the bound holds for either member, whatever the weights
    hostile = model + PAIR_RADIUS * 3 * model.norm() / 1000**0.5
    assert pair_average(torch.stack([model, hostile]), [1.0, 16.0]) is None
    assert aggregate("mean", torch.stack([model, hostile]), [1.0, 1.0]) is not None
    # what a member checks on a pair's average it receives
    assert within_pair_radius(mean, model)
    assert not within_pair_radius(model + model.norm(), model)


def test_a_robust_reducer_of_a_pair_leaves_far_apart_parts_local() -> None:
    reducer = WeightedMeanReducer([3, 3], ["a", "b"], aggregator="centered_clip")
    reducer.accumulate("a", 0, torch.tensor([1.0, 2.0, 3.0]))
    (near,) = reducer.accumulate("b", 0, torch.tensor([1.1, 2.0, 3.0]), weight=1.0)
    assert near.average is not None and torch.allclose(near.average, torch.tensor([1.05, 2, 3]))
    reducer.accumulate("a", 1, torch.tensor([1.0, 2.0, 3.0]))
    (far,) = reducer.accumulate("b", 1, torch.full((3,), -1000.0))
    assert far.average is None  # members keep their own values for this part


def test_a_member_refuses_a_pair_average_that_moves_it_too_far() -> None:
    flat = torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0, 6.0])
    check_pair(torch.tensor([1.05, 2.0, 3.0, 4.0, 5.0, 6.05]), flat, [(0, 0, 3), (3, 3, 6)])
    forged = torch.tensor([1.0, 2.0, 3.0, -496.0, -497.5, -497.0])
    with pytest.raises(ValueError, match="pair's average moves"):
        check_pair(forged, flat, [(0, 0, 3), (3, 3, 6)])
    # the forged part alone, at its offset in a batch of one
    with pytest.raises(ValueError, match="pair's average moves"):
        check_pair(forged[3:], flat, [(0, 3, 6)])
    check_pair(forged[:3], flat, [(0, 0, 3)])
