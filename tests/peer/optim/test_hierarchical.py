"""HierarchicalModelAverager without a network: which level averages at which step, and the
original's argument checks."""

from __future__ import annotations

from collections import OrderedDict

import pytest
import torch

from peer.optim.hierarchy.hierarchical import HierarchicalModelAverager, period_for_step
from peer.optim.hierarchy.levels import params_to_average


def test_the_largest_dividing_period_averages_after_warm_up() -> None:
    periods = [2, 4, 8]
    plan = [period_for_step(step, periods, warmup_steps=3) for step in range(17)]
    assert plan == [None, None, None, None, 4, None, 2, None, 8, None, 2, None, 4, None, 2, None, 8]
    assert [period_for_step(s, [3]) for s in range(4)] == [3, None, None, 3]


class _RecordingLevel:
    """Stands in for a swarm level: records the flat values it was given."""

    def __init__(self) -> None:
        self.calls: list[torch.Tensor] = []

    def average_(self, values: torch.Tensor) -> int:
        self.calls.append(values.clone())
        values.fill_(7.0)
        return 2

    def shutdown(self) -> None:
        pass


def test_average_parameters_drives_the_swarm_levels_at_their_steps() -> None:
    averager = HierarchicalModelAverager(
        OrderedDict([(2, 2), (6, None)]), warmup_steps=1, node=object()
    )
    levels = {2: _RecordingLevel(), 6: _RecordingLevel()}
    averager._swarm = levels  # type: ignore[assignment]
    model = torch.nn.Linear(2, 1)
    frozen = torch.nn.Parameter(torch.ones(3))  # no gradient: not averaged
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    for _ in range(7):
        averager.average_parameters([*model.parameters(), frozen])
    assert averager.step == 7
    assert len(levels[2].calls) == 2  # steps 2 and 4 (0 is warm-up, 6 is the top level's)
    assert len(levels[6].calls) == 1
    assert levels[6].calls[0].numel() == 3  # weight and bias, not the frozen tensor
    assert all(bool((p == 7.0).all()) for p in model.parameters())
    assert bool((frozen == 1.0).all())
    assert averager.rounds == {2: 2, 6: 1} and averager.skipped == {2: 0, 6: 0}


def test_a_skipped_swarm_round_is_counted_and_keeps_the_parameters() -> None:
    averager = HierarchicalModelAverager({2: 4}, node=object())

    class Skipping(_RecordingLevel):
        def average_(self, values: torch.Tensor) -> int:
            return 0

    averager._swarm = {2: Skipping()}  # type: ignore[assignment]
    p = torch.nn.Parameter(torch.arange(3.0))
    p.grad = torch.zeros(3)
    averager.average_parameters([p])
    assert averager.skipped == {2: 1} and averager.rounds == {2: 0}
    assert p.tolist() == [0.0, 1.0, 2.0]


def test_optimizer_param_groups_are_accepted() -> None:
    a, b = torch.nn.Parameter(torch.ones(2)), torch.nn.Parameter(torch.ones(3))
    a.grad = torch.zeros(2)
    opt = torch.optim.SGD([{"params": [a]}, {"params": [b], "lr": 0.1}], lr=1.0)
    assert params_to_average(opt.param_groups) == [a]
    with pytest.raises(TypeError, match="got float"):
        params_to_average([1.0])


def test_without_a_network_the_local_world_of_one_averages_alone() -> None:
    averager = HierarchicalModelAverager({2: 1, 4: 1})
    p = torch.nn.Parameter(torch.arange(3.0))
    p.grad = torch.zeros(3)
    for _ in range(5):
        averager.average_parameters([p])
    assert p.tolist() == [0.0, 1.0, 2.0] and averager.step == 5


@pytest.mark.parametrize(
    ("levels", "kwargs", "message"),
    [
        ({}, {}, "must not be empty"),
        (None, {}, "must not be empty"),
        ({0: 1}, {}, "must be a positive value"),
        (
            {2: 1, 4: 2},
            {},
            r"last value in arg ``period_group_size_dict`` 2 must be equal to the size of arg ``process_group`` 1",
        ),
        ({2: None}, {}, "must be equal to the size"),
        ({2: 1}, {"warmup_steps": -1}, "must be a non-negative number"),
        ({2: 3, 4: None}, {}, "must be equal to the size"),
    ],
)
def test_argument_errors_match_the_original(levels, kwargs, message) -> None:
    with pytest.raises(ValueError, match=message):
        HierarchicalModelAverager(levels, **kwargs)


def test_a_largest_period_of_one_warns_as_the_original() -> None:
    with pytest.warns(UserWarning, match="only\\s+DistributedDataParallel should be used"):
        HierarchicalModelAverager({1: 1})
