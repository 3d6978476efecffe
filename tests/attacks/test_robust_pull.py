"""A group member declares a weight inside the run's bound (16 times the group's median)
to pull CenteredClip towards its values: the clip bounds the distance it pulls from, the
weight would multiply it. The group averages with a run's defaults (those of
``TrainingConfig``); real nodes on loopback.

Defence guarded: CenteredClip's radius shrinks with a member's weight past the group's
median (``peer.averaging.allreduce.robust.centered_clip``), so a member pulls no harder than one of
the median weight. Without it the honest members end at 6.56."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from peer.averaging.allreduce.robust import centered_clip
from peer.tasks import TrainingConfig, load_task
from tests.attacks.conftest import Attack
from tests.peer.averaging.conftest import Swarm, step_all

SIZE = 4000


@pytest.fixture
def swarm() -> Iterator[Swarm]:
    swarm = Swarm(3)
    try:
        yield swarm
    finally:
        swarm.close()


def test_a_member_declaring_a_weight_inside_the_bound_pulls_no_harder(
    swarm: Swarm, attack: Attack
) -> None:
    """A group member declares weight 15 (inside the bound) to drag the average to its values

    Honest members hold 1 and 2 (weight 1), the attacker 7: with the weight multiplying its
    clipped pull they ended at 6.56; now it moves them no further than a member of the
    median weight would (CenteredClip of 1, 2, 7 alike: 2.48)."""
    config = TrainingConfig.from_run_config(load_task("digits"), {})
    assert config.aggregator == "centered_clip" and config.relative_weight_bound == 16.0
    tensors = [[torch.full((SIZE,), value)] for value in (1.0, 2.0, 7.0)]
    averagers = swarm.add_averagers(
        tensors,
        part_size_bytes=4096,
        aggregator=config.aggregator,
        relative_weight_bound=config.relative_weight_bound,
    )
    results = step_all(averagers, [{"weight": 1.0}, {"weight": 1.0}, {"weight": 15.0}])
    assert all(isinstance(r, dict) for r in results), results
    equal_weights = float(centered_clip(torch.tensor([[1.0], [2.0], [7.0]])))
    reached = max(float(t[0].max()) for t in tensors[:2])
    assert reached <= equal_weights + 1e-5, (reached, equal_weights)
    assert min(float(t[0].min()) for t in tensors[:2]) >= 1.5 - 1e-5  # they still average
    attack.outcome(f"its pull bounded as a median-weight member's ({equal_weights:.2f} at most)")
    attack.effect(f"honest members end at {reached:.2f} (6.56 with the weight multiplying it)")
