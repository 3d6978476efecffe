"""Volunteer.stop() with either swarm optimizer in training: the collaborative one's round in
flight is called off; DiLoCo, which has no round to call off from here, is left to its
shutdown — stop() (a signal handler's call) never raises."""

from __future__ import annotations

from pathlib import Path

import torch

from peer import DiLoCo, Node
from peer.volunteer import JoinOptions, Volunteer
from tests.conftest import scaled


def test_stop_with_a_diloco_optimizer_sets_the_stop_and_raises_nothing(tmp_path: Path) -> None:
    model = torch.nn.Linear(4, 1)
    node = Node(gossip_period=0.2)
    opt = DiLoCo(
        node=node,
        run_id="diloco-stop",
        params=model.parameters(),
        inner_optimizer=lambda p: torch.optim.SGD(p, lr=0.1),
        inner_steps=2,
        matchmaking_time=scaled(0.5),
        load_state_timeout=scaled(2),
    )
    volunteer = Volunteer(JoinOptions("http://c", "sgj_x", data_dir=tmp_path))
    volunteer._optimizer = opt
    try:
        volunteer.stop()
        volunteer.stop()  # idempotent
    finally:
        opt.shutdown()
        node.shutdown()
    assert volunteer._stopping.is_set() and volunteer._wake.is_set()


class Interruptible:
    """Stands in for peer.Optimizer: counts the calls to interrupt()."""

    def __init__(self) -> None:
        self.interrupted = 0

    def interrupt(self) -> None:
        self.interrupted += 1


def test_stop_calls_off_the_collaborative_optimizers_round(tmp_path: Path) -> None:
    volunteer = Volunteer(JoinOptions("http://c", "sgj_x", data_dir=tmp_path))
    optimizer = Interruptible()
    volunteer._optimizer = optimizer  # type: ignore[assignment]
    volunteer.stop()
    assert optimizer.interrupted == 1 and volunteer._stopping.is_set()
