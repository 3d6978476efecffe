"""Two honest members in a group of two, under a run's robust defaults (CenteredClip, the
weight bound): they have no majority to clip against, so each part is averaged only where
the pair's weighted mean moves neither member by more than ``PAIR_RADIUS`` of its own
values (``peer.averaging.allreduce.robust.pair_average``). Real nodes on loopback."""

from __future__ import annotations

from collections.abc import Callable

import torch

from peer.averaging.allreduce.robust import PAIR_RADIUS
from peer.tasks import TrainingConfig, load_task
from tests.peer.averaging.conftest import Swarm, step_all


def _pair_round(
    make_swarm: Callable[..., Swarm], values: list[torch.Tensor], weights: list[float]
) -> list[torch.Tensor]:
    config = TrainingConfig.from_run_config(load_task("digits"), {})
    tensors = [[v.clone()] for v in values]
    averagers = make_swarm(2).add_averagers(
        tensors,
        part_size_bytes=4096,
        aggregator=config.aggregator,
        relative_weight_bound=config.relative_weight_bound,
    )
    results = step_all(averagers, [{"weight": w} for w in weights])
    assert all(isinstance(r, dict) for r in results), results
    return [t[0] for t in tensors]


def test_two_honest_members_that_roughly_agree_end_on_their_weighted_mean(make_swarm) -> None:
    """Two copies of one model, a little apart (a state round): both end on the weighted
    mean of the two, batch sizes respected."""
    g = torch.Generator().manual_seed(0)
    model = torch.randn(4000, generator=g)
    other = model + 0.01 * torch.randn(4000, generator=g)
    ends = _pair_round(make_swarm, [model, other], [1.0, 3.0])
    mean = (model + 3 * other) / 4
    for end in ends:
        torch.testing.assert_close(end, mean, atol=1e-6, rtol=0)


def test_a_swarm_of_two_far_apart_averages_plainly(make_swarm) -> None:
    """Two volunteers are the whole swarm: no third peer to protect, no larger group to wait
    for. Values far apart (gradients of small batches usually are) still end on their
    weighted mean, so a two-volunteer run trains one model, not two."""
    g = torch.Generator().manual_seed(1)
    a, b = torch.randn(4000, generator=g), torch.randn(4000, generator=g)
    assert float((a - b).norm()) / 2 > PAIR_RADIUS * float(a.norm())
    ends = _pair_round(make_swarm, [a, b], [1.0, 3.0])
    for end in ends:
        torch.testing.assert_close(end, (a + 3 * b) / 4, atol=1e-6, rtol=0)


def test_a_pair_cut_from_a_larger_swarm_keeps_its_own_values_far_apart(make_swarm) -> None:
    """Three peers in the swarm, groups of two: a pair is not the whole swarm, so it
    holds its averages to the pair rule. Values too far apart for either to
    move that far: the round completes and each member keeps its own values, where a plain
    mean would have moved each by half their distance."""
    config = TrainingConfig.from_run_config(load_task("digits"), {})
    g = torch.Generator().manual_seed(1)
    values = [torch.randn(4000, generator=g) for _ in range(3)]
    assert float((values[0] - values[1]).norm()) / 2 > PAIR_RADIUS * float(values[0].norm())
    tensors = [[v.clone()] for v in values]
    averagers = make_swarm(3).add_averagers(
        tensors,
        part_size_bytes=4096,
        aggregator=config.aggregator,
        relative_weight_bound=config.relative_weight_bound,
        target_group_size=2,
        min_group_size=2,
    )
    results = step_all(averagers)
    paired = [i for i, r in enumerate(results) if isinstance(r, dict)]
    assert len(paired) == 2, results
    for i in range(3):  # the pair kept its own values, the third found no group
        assert torch.equal(tensors[i][0], values[i])
