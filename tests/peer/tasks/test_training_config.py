"""TrainingConfig: a run's config merged over its task's defaults, checked key by key."""

from __future__ import annotations

import dataclasses
import pickle
from collections.abc import Iterator, Mapping
from types import MappingProxyType
from typing import Any

import pytest
import torch

from peer.exceptions import SwarmgradError
from peer.tasks import Task, TaskError, TrainingConfig
from peer.tasks.base import BASE_DEFAULTS, peer_seed


class Toy(Task):
    name = "toy"
    metric_name = "score"
    higher_is_better = True
    defaults: Mapping[str, Any] = MappingProxyType(
        {"lr": 0.5, "batch_size": 4, "width": 3, "ratio": 0.25, "label": "a", "flag": False}
    )

    def check_params(self, params: Mapping[str, Any]) -> None:
        if params["width"] < 1:
            raise ValueError("width: must be at least 1")

    def build_model(self, config: TrainingConfig) -> torch.nn.Module:
        return torch.nn.Linear(config.params["width"], 1)

    def train_batches(self, config: TrainingConfig, peer_id: str) -> Iterator[Any]:
        raise NotImplementedError

    def loss(self, model: torch.nn.Module, batch: Any) -> torch.Tensor:
        raise NotImplementedError

    def batch_size(self, batch: Any) -> int:
        return len(batch)

    def evaluate(self, model: torch.nn.Module, config: TrainingConfig) -> float:
        return 0.0


def test_run_config_over_task_defaults_over_base_defaults() -> None:
    config = TrainingConfig.from_run_config(Toy(), {"lr": 0.1, "width": 7, "epochs": 12})
    assert (config.lr, config.epochs, config.batch_size) == (0.1, 12, 4)  # run, run, task
    assert config.target_batch_size == BASE_DEFAULTS["target_batch_size"]  # base
    assert dict(config.params) == {"width": 7, "ratio": 0.25, "label": "a", "flag": False}
    assert TrainingConfig.from_run_config(Toy(), None) == TrainingConfig.from_run_config(Toy(), {})


def test_json_numbers_are_taken_as_json_gives_them() -> None:
    # JSON has one number type: 512.0 is an integer, 1 is a float where a float is expected
    config = TrainingConfig.from_run_config(
        Toy(), {"target_batch_size": 512.0, "lr": 1, "ratio": 1, "epochs": None}
    )
    assert config.target_batch_size == 512 and isinstance(config.target_batch_size, int)
    assert config.lr == 1.0 and isinstance(config.lr, float)
    assert config.params["ratio"] == 1.0 and config.epochs is None


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("target_batch_size", 0),
        ("target_batch_size", 1.5),
        ("target_batch_size", "256"),
        ("target_batch_size", True),
        ("batch_size", -1),
        ("optimizer", "rmsprop"),
        ("optimizer", ["adam"]),
        ("lr", 0),
        ("lr", float("nan")),
        ("lr", "0.1"),
        ("momentum", 1.0),
        ("weight_decay", -0.1),
        ("epochs", 0),
        ("checkpoint_every", -1),
        ("seed", -1),
        ("seed", 2**64),
        ("matchmaking_time", 0),
        ("averaging_timeout", float("inf")),
        ("aggregator", "median"),
        ("aggregator", None),
        ("relative_weight_bound", 0.5),
        ("relative_weight_bound", float("inf")),
        ("relative_weight_bound", "4"),
        ("group_size", 1),
        ("group_size", 16.5),
        ("group_size", "16"),
        ("accumulation", 0),
        ("accumulation", 2.5),
        ("precision", "fp16"),
        ("max_grad_norm", -1.0),
        ("max_grad_norm", float("inf")),
        ("lr_schedule", "step"),
        ("warmup_epochs", -1),
        ("width", "wide"),  # task parameters: the default's type
        ("width", 2.5),
        ("width", 0),  # ... and the task's own range check
        ("ratio", None),
        ("label", 3),
        ("flag", 1),
        ("unknown_key", 1),  # neither a field nor a task parameter
        ("params", {"width": 2}),  # task parameters are top-level keys
    ],
)
def test_a_bad_value_is_refused_naming_its_key(key: str, value: Any) -> None:
    with pytest.raises(ValueError, match=f"^{key}: "):
        TrainingConfig.from_run_config(Toy(), {key: value})


def test_the_message_for_an_unknown_key_lists_the_known_ones() -> None:
    with pytest.raises(ValueError) as caught:
        TrainingConfig.from_run_config(Toy(), {"learning_rate": 0.1})
    assert "learning_rate" in str(caught.value) and "lr" in str(caught.value)
    assert "\n" not in str(caught.value)


def test_a_run_config_must_be_a_mapping() -> None:
    with pytest.raises(ValueError, match="mapping"):
        TrainingConfig.from_run_config(Toy(), [("lr", 0.1)])  # type: ignore[arg-type]


def test_the_config_is_frozen_and_checked_on_replace() -> None:
    config = TrainingConfig.from_run_config(Toy(), {})
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.lr = 1.0  # type: ignore[misc]
    with pytest.raises(TypeError):
        config.params["width"] = 9  # type: ignore[index]
    with pytest.raises(ValueError, match=r"^lr: "):
        dataclasses.replace(config, lr=-1.0)


def test_round_trips_through_pickle_and_its_run_config() -> None:
    config = TrainingConfig.from_run_config(Toy(), {"width": 5, "optimizer": "sgd"})
    assert pickle.loads(pickle.dumps(config)) == config  # spawned workers receive configs
    assert TrainingConfig.from_run_config(Toy(), config.to_run_config()) == config


@pytest.mark.parametrize(
    ("name", "cls", "expected"),
    [
        ("sgd", torch.optim.SGD, {"lr": 0.2, "momentum": 0.5, "weight_decay": 0.01}),
        ("adam", torch.optim.Adam, {"lr": 0.2, "weight_decay": 0.01}),
        ("adamw", torch.optim.AdamW, {"lr": 0.2, "weight_decay": 0.01}),
    ],
)
def test_make_optimizer_is_a_factory_of_the_named_optimizer(
    name: str, cls: type, expected: dict[str, float]
) -> None:
    config = TrainingConfig.from_run_config(
        Toy(), {"optimizer": name, "lr": 0.2, "momentum": 0.5, "weight_decay": 0.01}
    )
    factory = config.make_optimizer()
    pickle.dumps(factory)  # it crosses process boundaries too
    optimizer = factory(torch.nn.Linear(2, 1).parameters())
    assert type(optimizer) is cls
    group = optimizer.param_groups[0]
    assert {k: group[k] for k in expected} == expected


def test_peer_seeds_differ_across_peers_and_seeds_and_stay_put() -> None:
    seeds = {peer_seed(s, p) for s in (0, 1) for p in ("a", "b", "c")}
    assert len(seeds) == 6
    assert peer_seed(0, "a") == peer_seed(0, "a") < 2**63


def test_task_error_belongs_to_the_library_root() -> None:
    assert issubclass(TaskError, SwarmgradError)


def test_an_open_runs_robust_averaging_reaches_every_peers_optimizer() -> None:
    """The organizer sets the aggregator and the weight bound in the run's config; each
    volunteer's Optimizer (built from ``optimizer_options``) averages with them."""
    from peer import Node
    from peer.optim.collaborative.optimizer import Optimizer

    run = {"aggregator": "trimmed_mean", "relative_weight_bound": 4, "group_size": 16}
    config = TrainingConfig.from_run_config(Toy(), run)
    assert (config.aggregator, config.relative_weight_bound) == ("trimmed_mean", 4.0)
    assert config.group_size == 16
    assert TrainingConfig.from_run_config(Toy(), config.to_run_config()) == config
    node = Node(gossip_period=0.2)
    try:
        model = torch.nn.Linear(2, 1)
        opt = Optimizer(
            node=node, run_id="r", params=model.parameters(), **config.optimizer_options()
        )
        # the run's options, and a caller's own averager options over them
        built = config.make_swarm_optimizer(
            node, "r2", torch.nn.Linear(2, 1).parameters(), averager_opts={"min_group_size": 3}
        )
        try:
            for averager in (opt.grad_averager, opt.state_averager, built.state_averager):
                assert averager.allreduce_config.aggregator == "trimmed_mean"
                assert averager.allreduce_config.relative_weight_bound == 4.0
                assert averager.matchmaking_config.target_group_size == 16  # the grid's g
            assert built.state_averager.matchmaking_config.min_group_size == 3
        finally:
            built.shutdown()
            opt.shutdown()
    finally:
        node.shutdown()
    default = TrainingConfig.from_run_config(Toy(), {})
    assert (default.aggregator, default.relative_weight_bound) == ("centered_clip", 16.0)
    assert default.group_size is None and default.optimizer_options()["averager_opts"] == {}
