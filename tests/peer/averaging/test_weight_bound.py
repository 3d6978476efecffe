"""A contribution's weight has an upper bound (``max_weight``): a peer that claims a huge
weight to take over the mean is excluded, named in the log, and the honest peers end with
the mean over themselves."""

from __future__ import annotations

import logging

import pytest
import torch

from peer.averaging.allreduce.reducer import BadContribution, WeightedMeanReducer
from tests.conftest import scaled
from tests.peer.averaging.conftest import step_all


def test_the_reducer_refuses_a_weight_over_its_bound() -> None:
    reducer = WeightedMeanReducer([4], ["a", "b"], max_weight=100.0)
    reducer.accumulate("a", 0, torch.ones(4), weight=100.0)
    with pytest.raises(BadContribution, match="over the bound of 100"):
        reducer.accumulate("b", 0, torch.ones(4), weight=1e30)
    with pytest.raises(ValueError):
        WeightedMeanReducer([4], ["a"], max_weight=0.0)


def test_a_peer_claiming_a_weight_of_1e30_is_excluded(make_swarm, caplog) -> None:
    swarm = make_swarm(3)
    tensors = [[torch.randn(4000)] for _ in range(3)]
    local = [t[0].clone() for t in tensors]
    honest_mean = (local[0] + local[1]) / 2
    # the attacker reduces nothing: every span is an honest reducer's
    averagers = swarm.add_averagers(
        tensors, part_size_bytes=4096, max_weight=1e6, per_peer=[{}, {}, {"bandwidth": 0.0}]
    )
    with caplog.at_level(logging.WARNING, logger="peer.averaging"):
        # the attacker, excluded, hears no average: its own step only ends at its timeout
        attack = {"weight": 1e30, "timeout": scaled(6)}
        results = step_all(averagers, [{"weight": 3.0}, {"weight": 3.0}, attack])
    for i in (0, 1):
        assert isinstance(results[i], dict), results[i]
        torch.testing.assert_close(tensors[i][0], honest_mean, atol=1e-6, rtol=0)
    attacker = averagers[2].peer_id
    named = [r.getMessage() for r in caplog.records if attacker in r.getMessage()]
    assert named and all("over the bound" in m for m in named), named
