"""DiLoCo peers catching up with the swarm's outer state, honestly: a newcomer from a single
donor, a peer left behind from donors that agree. In one process over loopback."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from peer import Node
from swarmlab.node_process import wait_until
from tests.conftest import scaled
from tests.peer.optim.diloco_peers import Trainer, make_nodes


@pytest.fixture
def swarm() -> Iterator[tuple[list[Node], list[Trainer]]]:
    nodes: list[Node] = []
    trainers: list[Trainer] = []
    yield nodes, trainers
    for t in trainers:
        t.close()
    for node in nodes:
        node.shutdown()


def _train(trainers: list[Trainer], sync: int) -> None:
    for t in trainers:
        t.train_until(sync)
    assert wait_until(lambda: all(t.done() for t in trainers), scaled(120)), [
        t.sync for t in trainers
    ]
    assert all(t.sync == sync for t in trainers), [t.sync for t in trainers]


def _equal(a: Trainer, b: Trainer) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a.outer_state(), b.outer_state(), strict=True))


def test_a_newcomer_loads_the_outer_state_from_a_single_honest_donor(
    swarm: tuple[list[Node], list[Trainer]],
) -> None:
    """One peer trained alone to sync 2; a newcomer finds it the only donor, nobody
    contradicts it and its sync is the one the run's reports show: the newcomer takes its
    outer state and starts at its sync."""
    nodes, trainers = swarm
    nodes += make_nodes(2)
    donor = Trainer(nodes[0], 0)
    trainers.append(donor)
    _train([donor], 2)
    newcomer = Trainer(nodes[1], 1)  # loads the swarm's state as it is built
    trainers.append(newcomer)
    assert newcomer.sync == 2
    assert newcomer.opt.state_averager.last_state_donor == nodes[0].peer_id
    assert _equal(newcomer, donor)
    # and it takes part in the next sync with the donor
    _train(trainers, 3)
    assert _equal(newcomer, donor)


def test_a_peer_left_behind_loads_the_state_two_other_volunteers_hold(
    swarm: tuple[list[Node], list[Trainer]],
) -> None:
    """Three peers at sync 2; one pauses while the two others sync on to 4. Back, it holds a
    state of its own, so it replaces it only with one another volunteer confirms: it
    downloads one donor's state, the other holds the same, and it loads it once."""
    nodes, trainers = swarm
    nodes += make_nodes(3)
    trainers += [Trainer(nodes[i], i) for i in range(3)]
    _train(trainers, 2)
    behind, *others = trainers
    _train(others, 4)
    assert _equal(others[0], others[1])
    _train([behind], 4)
    assert behind.adopted == [4]
    assert _equal(behind, others[0])
