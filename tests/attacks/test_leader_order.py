"""A hostile peer tries to lead the groups honest peers join and pair itself with one of
them: it declares a start time with no matchmaking wait (by start time it would go first in
the order every peer follows) and asks for groups of two, where CenteredClip has no
majority to clip against.

Defences guarded: the order is a rank no declaration chooses
(``MatchmakingConfig.order="rank"``, ``Declaration.rank``); and a pair averages only within
``PAIR_RADIUS`` of each member's own values, which every member checks on the averages it
receives (``robust.pair_average``, ``butterfly_results.check_pair``). Without the first
the hostile peer leads every round; without the second its honest partner ends at -937."""

from __future__ import annotations

import logging
import random
from collections.abc import Iterator

import pytest
import torch

from peer.averaging.allreduce.robust import PAIR_RADIUS
from peer.averaging.matchmaking.machine import BeginAllreduce, Matchmaker, MatchmakingConfig
from peer.tasks import TrainingConfig, load_task
from tests.attacks.conftest import Attack
from tests.conftest import scaled
from tests.peer.averaging.conftest import Swarm, step_all
from tests.peer.averaging.test_matchmaking import Bus

HONEST = ["alice", "bob", "carol"]
ROUNDS = 40


def test_declaring_no_matchmaking_wait_does_not_put_a_peer_first(attack: Attack) -> None:
    """A peer declares a start time with no matchmaking wait to lead every group

    Three honest peers (a run's matchmaking defaults) and the hostile one (no wait, groups
    of two) match 40 rounds, each under its own group key: by declared start time it would
    lead all 40 and pair itself with one honest peer; by rank it leads about a quarter."""
    honest_config = MatchmakingConfig(min_matchmaking_time=5.0, request_timeout=3.0)
    hostile_config = MatchmakingConfig(
        target_group_size=2, min_matchmaking_time=0.0, request_timeout=3.0
    )
    led = 0
    for rnd in range(ROUNDS):
        key = f"run_grad_averager.0b{rnd:08b}"
        machines = {p: Matchmaker(p, honest_config) for p in HONEST}
        machines["mallory"] = Matchmaker("mallory", hostile_config)
        bus = Bus(machines, random.Random(rnd), fair=True, crashed=set())
        for peer, machine in machines.items():
            bus.execute(peer, machine.start(0.0, group_key=key, schema_hash=b"s", deadline=13.0))
        bus.run()
        for peer in HONEST:  # every honest peer gets a round
            (outcome,) = bus.outcomes[peer]
            assert isinstance(outcome, BeginAllreduce), (rnd, peer, outcome)
        (outcome,) = bus.outcomes["mallory"]
        if isinstance(outcome, BeginAllreduce) and outcome.group.leader == "mallory":
            led += 1
    assert led <= ROUNDS // 2, led  # by rank, each of four peers leads about a quarter
    attack.outcome(f"led {led} of {ROUNDS} rounds (by declared start time: all {ROUNDS})")
    attack.effect("every honest peer got a group in every round")


@pytest.fixture
def pair() -> Iterator[Swarm]:
    """Three nodes: the pair's two averagers and an honest peer left out of the round (in
    a swarm of two, the pair is the whole swarm and averages plainly)."""
    swarm = Swarm(3)
    try:
        yield swarm
    finally:
        swarm.close()


def test_a_hostile_peer_paired_with_one_honest_peer_cannot_move_it(
    pair: Swarm, attack: Attack, caplog: pytest.LogCaptureFixture
) -> None:
    """A hostile peer pairs with one honest peer, sends -1000 with weight 15, reduces by the mean

    The honest peer (a run's defaults) would end at -937; it keeps its own values where the
    pair's average would move it by more than a tenth of their norm, and refuses the
    averages the hostile reducer computed by the plain mean."""
    config = TrainingConfig.from_run_config(load_task("digits"), {})
    g = torch.Generator().manual_seed(0)
    honest = 1.0 + 0.1 * torch.randn(4000, generator=g)
    tensors = [[honest.clone()], [torch.full((4000,), -1000.0)]]
    hostile = {
        "aggregator": "mean",
        "relative_weight_bound": None,
        "min_matchmaking_time": 0.0,
        "target_group_size": 2,
    }
    averagers = pair.add_averagers(
        tensors,
        part_size_bytes=4096,
        aggregator=config.aggregator,
        relative_weight_bound=config.relative_weight_bound,
        per_peer=[{}, hostile],
    )
    with caplog.at_level(logging.WARNING, logger="peer.averaging"):
        attacking = {"weight": 15.0, "timeout": scaled(8), "allow_retries": False}
        results = step_all(averagers, [{"weight": 1.0}, attacking])
    moved = float((tensors[0][0] - honest).norm())
    assert moved <= PAIR_RADIUS * float(honest.norm()) * 1.1, moved
    assert float(tensors[0][0].min()) > 0.0
    assert isinstance(results[0], dict), results[0]  # a round, not a failure
    named = "\n".join(
        r.getMessage() for r in caplog.records if averagers[1].peer_id in r.getMessage()
    )
    assert "pair's average" in named, named
    attack.outcome("its averages refused by the honest member, named in a warning")
    attack.effect(f"the honest peer moved {moved:.3g} (its values' norm {honest.norm():.3g})")
