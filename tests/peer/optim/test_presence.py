"""A peer that takes no step (a paused run) stays counted by the others while it reports its
presence (``report_presence``); one that says nothing lapses once its report expires."""

from __future__ import annotations

import time
from collections.abc import Iterator
from functools import partial

import pytest
import torch

from peer import Node
from peer.optim.collaborative import optimizer as collaborative
from peer.optim.collaborative.optimizer import Optimizer
from peer.optim.shared.progress import ProgressTracker
from swarmlab.node_process import wait_until
from tests.conftest import scaled

EXPIRATION_S = scaled(2.0)  # the progress reports' lifetime here (the optimizer's: a minute)


@pytest.fixture
def pair() -> Iterator[tuple[Node, Node]]:
    first = Node(gossip_period=0.2)
    second = Node(first.visible_addresses, gossip_period=0.2)
    both = (first, second)
    try:
        assert wait_until(lambda: all(len(n.members()) == 2 for n in both), scaled(15))
        yield both
    finally:
        for node in reversed(both):
            node.shutdown()


def _optimizer(node: Node) -> Optimizer:
    return Optimizer(
        node=node,
        run_id="presence",
        target_batch_size=32,
        batch_size_per_step=16,
        optimizer=partial(torch.optim.SGD, lr=0.1),
        params=torch.nn.Linear(4, 1).parameters(),
        matchmaking_time=scaled(1.0),
        load_state_timeout=scaled(5),
    )


def test_a_peer_that_reports_its_presence_stays_counted_and_a_silent_one_lapses(
    pair: tuple[Node, Node], monkeypatch: pytest.MonkeyPatch
) -> None:
    def short_lived(node: Node, prefix: str, target: int, **_: float) -> ProgressTracker:
        return ProgressTracker(node, prefix, target, expiration=EXPIRATION_S)

    monkeypatch.setattr(collaborative, "ProgressTracker", short_lived)
    opts = [_optimizer(node) for node in pair]
    try:
        present, silent = opts
        assert wait_until(lambda: all(o.tracker.others_reporting() == 1 for o in opts), scaled(15))
        # twice the lifetime: the silent peer's report lapses, the other one's never does
        until = time.monotonic() + 2 * EXPIRATION_S
        while time.monotonic() < until:
            present.report_presence()
            silent.tracker.fetch(fresh=True)
            assert silent.tracker.others_reporting() == 1, "a peer reporting its presence lapsed"
            time.sleep(0.2)  # the pace of a paused trainer's reports, faster
        assert wait_until(lambda: present.tracker.others_reporting() == 0, scaled(15))
    finally:
        for opt in opts:
            opt.shutdown()
