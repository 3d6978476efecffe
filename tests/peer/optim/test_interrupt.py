"""``interrupt()`` calls off the averaging round in flight, from another thread (as a
volunteer's Ctrl-C does): the step waiting on it returns long before the round would end,
for the collaborative optimizer and DiLoCo alike."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from functools import partial
from typing import Any

import pytest
import torch

from peer import DiLoCo, Node, Optimizer
from swarmlab.node_process import wait_until
from tests.conftest import scaled

# a round that would look for a third peer for a minute
WAIT = {"matchmaking_time": 60.0, "averaging_timeout": 120.0}


def _collaborative(node: Node, model: torch.nn.Module) -> Optimizer:
    return Optimizer(
        node=node,
        run_id="interrupt-collab",
        target_batch_size=2,
        batch_size_per_step=1,
        optimizer=partial(torch.optim.SGD, lr=0.1),
        params=model.parameters(),
        averager_opts={"target_group_size": 3},
        **WAIT,
    )


def _diloco(node: Node, model: torch.nn.Module) -> DiLoCo:
    return DiLoCo(
        node=node,
        run_id="interrupt-diloco",
        params=model.parameters(),
        inner_optimizer=partial(torch.optim.SGD, lr=0.1),
        inner_steps=1,
        outer_optimizer=partial(torch.optim.SGD, lr=1.0),
        averager_opts={"target_group_size": 3},
        load_state_timeout=scaled(5),
        **WAIT,
    )


@pytest.mark.parametrize("make", [_collaborative, _diloco], ids=["collaborative", "diloco"])
def test_interrupt_calls_off_the_round_in_flight(
    nodes: list[Node], make: Callable[[Node, torch.nn.Module], Any]
) -> None:
    models = [torch.nn.Linear(2, 1) for _ in nodes]
    opts = [make(node, model) for node, model in zip(nodes, models, strict=True)]
    try:
        assert wait_until(lambda: all(o.tracker.others_reporting() == 1 for o in opts), 15)

        def step(rank: int) -> None:
            # one sample each, then steps without samples until the epoch's round (which
            # waits for a third peer) ends: DiLoCo's first step syncs and waits on it
            opt = opts[rank]
            models[rank](torch.ones(1, 2)).sum().backward()
            opt.step(batch_size=1)
            while isinstance(opt, Optimizer) and opt.local_epoch == 0:
                opt.step(batch_size=0)
                time.sleep(0.02)

        threads = [threading.Thread(target=step, args=(r,), daemon=True) for r in range(2)]
        for t in threads:
            t.start()
        assert wait_until(lambda: all(o._pending.round is not None for o in opts), scaled(30))
        for opt in opts:
            opt.interrupt()
        for t in threads:
            t.join(scaled(15))  # (the round would have looked for a group for a minute)
        assert not any(t.is_alive() for t in threads)
        assert all(o._pending.round is None for o in opts)
        assert [o.rounds_failed for o in opts] == [0, 0]  # called off, not failed
        if isinstance(opts[0], Optimizer):  # its state round was called off too; it stepped
            assert [o.local_epoch for o in opts] == [1, 1]
    finally:
        for opt in opts:
            opt.shutdown()
