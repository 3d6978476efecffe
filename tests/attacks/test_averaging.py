"""One member of a run's averaging group tries to write its values into everyone's: with a
huge weight, with huge finite values, or as the reducer of a span, by returning them as its
average. The group averages with a run's defaults (those of ``TrainingConfig``, as every
volunteer's optimizer does); real nodes on loopback."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import pytest
import torch

from peer.averaging.allreduce.reducer import FinishedPart
from peer.averaging.allreduce.round import ButterflyRound
from peer.averaging.allreduce.runner import AllreduceRunner, RunnerFactory
from peer.tasks import TrainingConfig, load_task
from swarmlab.averager_doubles import averager_with
from tests.attacks.conftest import Attack
from tests.conftest import scaled
from tests.peer.averaging.conftest import Swarm, step_all

SIZE = 4000
HONEST = 3


@pytest.fixture
def swarm() -> Iterator[Swarm]:
    swarm = Swarm(HONEST + 1)
    try:
        yield swarm
    finally:
        swarm.close()


class _ForgingRound(ButterflyRound):
    """Reduces its span as the others do, then sends every member 1e37 as its average."""

    def _on_finished(self, finished: list[FinishedPart]) -> None:
        for done in finished:
            if done.average is not None:
                done.average.fill_(1e37)
        super()._on_finished(finished)


class _ForgingRunner(AllreduceRunner):
    round_class = _ForgingRound


def _attacked_round(
    swarm: Swarm,
    caplog: pytest.LogCaptureFixture,
    weight: float,
    values: float | None,
    runner: RunnerFactory | None = None,
) -> tuple[list[torch.Tensor], torch.Tensor, float, str]:
    """Three honest members (weight 1, values N(0, 1)) and the attacker (``weight``, every
    value ``values``, or honest-looking ones for None; its round driven by ``runner``)
    average once with the run's defaults. Returns the honest members' results, their
    values' mean, their largest distance from it, and what was logged naming the
    attacker."""
    config = TrainingConfig.from_run_config(load_task("digits"), {})
    g = torch.Generator().manual_seed(0)
    tensors = [[torch.randn(SIZE, generator=g)] for _ in range(HONEST)]
    if values is None:
        tensors.append([torch.randn(SIZE, generator=g)])
    else:
        tensors.append([torch.full((SIZE,), values)])
    honest = torch.stack([t[0] for t in tensors[:HONEST]])  # [members, SIZE]
    honest_mean = honest.mean(dim=0)
    spread = float((honest - honest_mean).norm(dim=1).max())
    averagers = swarm.add_averagers(
        tensors,
        part_size_bytes=4096,
        aggregator=config.aggregator,
        relative_weight_bound=config.relative_weight_bound,
        per_peer=[{}] * HONEST + [{"averager_class": averager_with(runner=runner)}],
    )
    attacker = averagers[HONEST].peer_id
    with caplog.at_level(logging.WARNING, logger="peer.averaging"):
        # an excluded attacker hears no average: its own step ends at its timeout
        attacking = {"weight": weight, "timeout": scaled(8), "allow_retries": False}
        kwargs = [{"weight": 1.0}] * HONEST + [attacking]
        results = step_all(averagers, kwargs)
    for result in results[:HONEST]:
        assert isinstance(result, dict), result
    named = "\n".join(r.getMessage() for r in caplog.records if attacker in r.getMessage())
    return [t[0] for t in tensors[:HONEST]], honest_mean, spread, named


def _assert_near(results: list[torch.Tensor], honest_mean: torch.Tensor, spread: float) -> float:
    """Every honest result is finite and no further from the honest mean than the honest
    members' own values are: the attacker moved it less than honest disagreement does."""
    gap = max(float((r - honest_mean).norm()) for r in results)
    assert all(torch.isfinite(r).all() for r in results)
    assert gap <= spread, (gap, spread)
    return gap


def test_a_member_claiming_a_weight_of_1e30_is_excluded(
    swarm: Swarm, attack: Attack, caplog: pytest.LogCaptureFixture
) -> None:
    """A group member declares a weight of 1e30 to set everyone's parameters

    With the plain mean its values would be the group's result; a run's weight bound
    (a factor of the group's median weight) excludes it before anything is sent, and the
    honest members end on their exact mean."""
    results, honest_mean, spread, named = _attacked_round(swarm, caplog, 1e30, 100.0)
    gap = _assert_near(results, honest_mean, spread)
    # every member left it out of the partition alike: no span stays at local values
    assert gap < 1e-3, gap
    assert "over the bound" in named, named
    attack.outcome("excluded from the round by the weight bound, named in a warning")
    attack.effect(f"honest results {gap:.3g} from their mean (their own spread {spread:.3g})")


def test_a_member_sending_values_of_1e37_cannot_drag_the_average(
    swarm: Swarm, attack: Attack, caplog: pytest.LogCaptureFixture
) -> None:
    """A group member sends finite values of 1e37 to set everyone's parameters

    With the plain mean a quarter of 1e37 would be everyone's result; a run's CenteredClip
    bounds its pull to the honest members' own spread, and names it."""
    results, honest_mean, spread, named = _attacked_round(swarm, caplog, 1.0, 1e37)
    gap = _assert_near(results, honest_mean, spread)
    assert "median distance" in named, named
    attack.outcome("its pull clipped by CenteredClip, named in a warning")
    attack.effect(f"honest results {gap:.3g} from their mean (their own spread {spread:.3g})")


def test_a_reducer_returning_values_of_1e37_as_its_average_is_excluded(
    swarm: Swarm, attack: Attack, caplog: pytest.LogCaptureFixture
) -> None:
    """A group member returns values of 1e37 as the average of the span it reduces

    Its contributions look honest; the averages it sends back are forged. No CenteredClip
    of the group holds values a million times over a member's own: each honest member
    excludes it as a reducer with a bad average (its span keeps their local values) and
    names it."""
    results, honest_mean, spread, named = _attacked_round(swarm, caplog, 1.0, None, _ForgingRunner)
    gap = _assert_near(results, honest_mean, spread)
    assert "bad average" in named and "1e+37" in named, named
    attack.outcome("excluded as a reducer with a bad average, named in a warning")
    attack.effect(f"honest results {gap:.3g} from their mean (their own spread {spread:.3g})")
