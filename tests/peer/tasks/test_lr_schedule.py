"""The learning rate of a swarm epoch: warm-up, then constant, linear or cosine decay."""

from __future__ import annotations

import itertools
import math

import pytest

from peer.tasks.base import TrainingConfig
from peer.tasks.schedule import lr_factor


def test_warm_up_climbs_linearly_to_the_full_rate() -> None:
    factors = [lr_factor(e, schedule="constant", warmup_epochs=3, epochs=None) for e in range(6)]
    assert factors == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]


@pytest.mark.parametrize("schedule", ["linear", "cosine"])
def test_a_decay_goes_from_the_full_rate_after_warm_up_to_zero_at_the_last_epoch(
    schedule: str,
) -> None:
    factors = [lr_factor(e, schedule=schedule, warmup_epochs=2, epochs=12) for e in range(13)]
    assert factors[2] == 1.0 and factors[12] == 0.0
    assert all(a > b for a, b in itertools.pairwise(factors[2:]))
    middle = factors[7]  # half way through the decay
    assert math.isclose(middle, 0.5)


def test_cosine_decays_slower_than_linear_at_first_and_faster_at_the_end() -> None:
    def at(schedule: str, epoch: int) -> float:
        return lr_factor(epoch, schedule=schedule, warmup_epochs=0, epochs=10)

    assert at("cosine", 2) > at("linear", 2)
    assert at("cosine", 8) < at("linear", 8)


def test_the_config_gives_each_epoch_its_rate() -> None:
    config = TrainingConfig(
        target_batch_size=64,
        batch_size=8,
        optimizer="sgd",
        lr=0.4,
        epochs=10,
        lr_schedule="linear",
        warmup_epochs=1,
    )
    assert [config.lr_at(e) for e in (0, 1, 10)] == [0.2, 0.4, 0.0]
    assert TrainingConfig(target_batch_size=64, batch_size=8, optimizer="sgd", lr=0.4).lr_at(
        1000
    ) == pytest.approx(0.4)


def test_the_samples_behind_a_step_count_every_micro_batch() -> None:
    config = TrainingConfig(
        target_batch_size=64, batch_size=8, optimizer="sgd", lr=0.1, accumulation=4
    )
    assert config.samples_per_step == 32
    assert config.optimizer_options()["batch_size_per_step"] == 32
