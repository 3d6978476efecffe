"""The optimizers' rounds on the Moshpit grid (``target_group_size`` set), with six or seven
peers in one process over loopback WebSockets: a 3 x 2 grid, with one extra for seven."""

from __future__ import annotations

import threading
import time
from functools import partial

import pytest
import torch

from peer import DiLoCo, Node
from peer.averaging.matchmaking.grid import GridHistory, grid_for, place_next, rounds_to_mean
from peer.averaging.matchmaking.group_bits import group_key
from peer.optim.collaborative.optimizer import Optimizer
from swarmlab.node_process import wait_until
from tests.conftest import scaled

PEERS = 7
TARGET = 4

pytestmark = pytest.mark.slow


def _swarm(n: int) -> list[Node]:
    nodes = [Node(gossip_period=0.2)]
    nodes += [Node(nodes[0].visible_addresses, gossip_period=0.2) for _ in range(n - 1)]
    return nodes


def _expected_groups(peers: list[str], rounds: int) -> list[set[frozenset[str]]]:
    """The groups the grid forms in each round when every peer sees all of them."""
    history = dict.fromkeys(peers, GridHistory())
    out = []
    for r in range(rounds):
        keys: dict[str, list[str]] = {}
        for p in peers:
            place, history[p] = place_next(history[p], peers, p, TARGET, r)
            keys.setdefault(group_key("x", place.bits, TARGET), []).append(p)
        out.append({frozenset(g) for g in keys.values()})
    return out


def test_the_rounds_take_the_grids_groups_and_reach_the_mean_of_the_parameters() -> None:
    grid = grid_for(PEERS, TARGET)
    assert grid.extras, "the scenario needs a cell with two peers (unequal slabs)"
    rounds = rounds_to_mean(PEERS, TARGET)
    nodes = _swarm(PEERS)
    models = [torch.nn.Linear(3, 2) for _ in range(PEERS)]
    opts: list[Optimizer] = []
    try:
        for node, model in zip(nodes, models, strict=True):
            opts.append(
                Optimizer(
                    node=node,
                    run_id="grid",
                    target_batch_size=PEERS,
                    batch_size_per_step=1,
                    optimizer=partial(torch.optim.SGD, lr=0.0),  # only the rounds move them
                    params=model.parameters(),
                    matchmaking_time=0.5,
                    averaging_timeout=scaled(20),
                    averager_opts={"target_group_size": TARGET},
                )
            )
        assert wait_until(
            lambda: all(len(opt.tracker.peers_at(0)[0]) == PEERS for opt in opts), scaled(30)
        )
        # distinct parameters on every peer (a newcomer had downloaded the first one's)
        generator = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for model in models:
                for p in model.parameters():
                    p.copy_(torch.randn(p.shape, generator=generator))
        mean = [
            torch.stack([list(m.parameters())[i].detach() for m in models]).mean(0)
            for i in range(2)
        ]
        groups: list[list[frozenset[str]]] = [[] for _ in range(rounds)]
        errors: list[BaseException] = []

        def run(rank: int) -> None:
            model, opt = models[rank], opts[rank]
            deadline = time.monotonic() + scaled(120)
            try:
                while opt.local_epoch < rounds and time.monotonic() < deadline:
                    epoch = opt.local_epoch
                    model(torch.ones(1, 3)).sum().backward()
                    opt.step()
                    opt.zero_grad()
                    while opt.local_epoch == epoch and time.monotonic() < deadline:
                        opt.step(batch_size=0)
                        time.sleep(0.02)
                    groups[epoch].append(opt.state_averager.last_group)
            except BaseException as exc:  # (reported by the main thread)
                errors.append(exc)

        threads = [threading.Thread(target=run, args=(r,)) for r in range(PEERS)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors, errors
        assert [opt.local_epoch for opt in opts] == [rounds] * PEERS
        assert [opt.rounds.rounds_failed for opt in opts] == [0] * PEERS
        expected = _expected_groups([node.peer_id for node in nodes], rounds)
        for r in range(rounds):
            assert set(groups[r]) == expected[r], f"round {r}"
        for model in models:  # the grid's weights make the unequal slabs count equally
            for p, m in zip(model.parameters(), mean, strict=True):
                torch.testing.assert_close(p.detach(), m, rtol=0, atol=1e-5)
    finally:
        for opt in opts:
            opt.shutdown()
        for node in reversed(nodes):
            node.shutdown()


def test_diloco_syncs_take_the_grids_groups() -> None:
    """Sync ``k`` (one fragment) averages along dimension ``k``: each sync's group is a line
    of the grid of the six peers."""
    peers, h, syncs = 6, 2, 2
    nodes = _swarm(peers)
    models = [torch.nn.Linear(3, 2) for _ in range(peers)]
    opts: list[DiLoCo] = []
    try:
        for node, model in zip(nodes, models, strict=True):
            opts.append(
                DiLoCo(
                    node=node,
                    run_id="diloco-grid",
                    params=model.parameters(),
                    inner_optimizer=partial(torch.optim.SGD, lr=0.1),
                    inner_steps=h,
                    outer_optimizer=partial(torch.optim.SGD, lr=1.0),
                    matchmaking_time=0.5,
                    averager_opts={"target_group_size": TARGET},
                    load_state_timeout=scaled(5),
                )
            )
        assert wait_until(
            lambda: all(len(opt.tracker.peers_at(0)[0]) == peers for opt in opts), scaled(30)
        )
        expected = _expected_groups([node.peer_id for node in nodes], syncs)
        for k in range(syncs):

            def train(rank: int) -> None:
                for _ in range(h):
                    models[rank](torch.full((1, 3), float(rank))).sum().backward()
                    opts[rank].step(batch_size=1)
                    opts[rank].zero_grad()

            threads = [threading.Thread(target=train, args=(r,)) for r in range(peers)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(scaled(60))
            assert all(opt.wait_for_pending(timeout=scaled(30)) for opt in opts)
            assert [opt.rounds_done for opt in opts] == [k + 1] * peers
            assert {opt.averagers[0].last_group for opt in opts} == expected[k], f"sync {k}"
    finally:
        for opt in opts:
            opt.shutdown()
        for node in reversed(nodes):
            node.shutdown()
