"""A run's ``algorithm: diloco`` and its settings: checked key by key, and the optimizer a
volunteer builds from them."""

from __future__ import annotations

import dataclasses
import pickle
from typing import Any

import pytest
import torch

from peer.tasks import TrainingConfig
from peer.tasks.charlm import CharLMTask

RUN = {
    "algorithm": "diloco",
    "inner_steps": 8,
    "outer_lr": 0.5,
    "outer_momentum": 0.8,
    "fragments": 2,
    "compression": "int8",
    "overlap": True,
}


def test_a_run_chooses_diloco_and_its_settings() -> None:
    config = TrainingConfig.from_run_config(CharLMTask(), RUN)
    assert (config.algorithm, config.inner_steps, config.fragments) == ("diloco", 8, 2)
    assert (config.outer_lr, config.outer_momentum) == (0.5, 0.8)
    assert (config.compression, config.overlap) == ("int8", True)
    # the settings survive the trip through a run's config and through pickling
    assert TrainingConfig.from_run_config(CharLMTask(), config.to_run_config()) == config
    assert pickle.loads(pickle.dumps(config)) == config
    default = TrainingConfig.from_run_config(CharLMTask(), {})
    assert default.algorithm == "collaborative"


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"algorithm": "gossip"}, "algorithm: expected one of collaborative, diloco"),
        ({"inner_steps": 0}, "inner_steps: must be at least 1"),
        ({"inner_steps": 2.5}, "inner_steps: expected an integer"),
        ({"outer_lr": 0}, "outer_lr: must be positive"),
        ({"outer_momentum": 1.0}, r"outer_momentum: must be in \[0, 1\)"),
        ({"fragments": 9}, "fragments: at most inner_steps"),
        ({"fragments": 0}, "fragments: must be at least 1"),
        ({"compression": "zip"}, "compression: unknown compression 'zip'"),
        ({"compression": 8}, "compression: a compression name must be a string"),
        ({"overlap": "yes"}, "overlap: expected true or false"),
    ],
)
def test_bad_diloco_settings_name_the_key(change: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        TrainingConfig.from_run_config(CharLMTask(), {**RUN, **change})
    config = TrainingConfig.from_run_config(CharLMTask(), RUN)
    with pytest.raises(ValueError, match=message):
        dataclasses.replace(config, **change)


def test_a_volunteer_builds_diloco_from_the_config() -> None:
    from peer import Node
    from peer.optim.collaborative.optimizer import Optimizer
    from peer.optim.diloco.outer import DiLoCo

    task = CharLMTask()
    config = TrainingConfig.from_run_config(task, {**RUN, "d_model": 16, "n_layers": 1})
    node = Node(gossip_period=0.2)
    try:
        model = task.build_model(config)
        opt = config.make_swarm_optimizer(node, "r", model.parameters())
        try:
            assert isinstance(opt, DiLoCo)
            assert (opt.inner_steps, len(opt.fragments), opt.overlap) == (8, 2, True)
            assert opt.compression.name == "blockwise_8bit"
            outer = opt.outer_optimizer
            assert isinstance(outer, torch.optim.SGD)
            group = outer.param_groups[0]
            assert (group["lr"], group["momentum"], group["nesterov"]) == (0.5, 0.8, True)
            inner = opt.inner_optimizer
            assert isinstance(inner, torch.optim.AdamW)
            assert inner.param_groups[0]["lr"] == config.lr
        finally:
            opt.shutdown()
        plain = dataclasses.replace(config, algorithm="collaborative")
        opt = plain.make_swarm_optimizer(node, "r2", model.parameters())
        try:
            assert isinstance(opt, Optimizer)
        finally:
            opt.shutdown()
    finally:
        node.shutdown()
