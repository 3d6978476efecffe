"""Two volunteers are a whole swarm: under a run's robust defaults (CenteredClip) they still
train one model. Their pseudo-gradients lie further apart than the pair rule lets a pair
average, which holds only where a third live peer exists (``peer.averaging.averager``)."""

from __future__ import annotations

import threading
from functools import partial

import torch

from peer import Node
from peer.optim.buffers import model_buffers
from peer.optim.diloco.outer import DiLoCo
from swarmlab.node_process import wait_until
from tests.conftest import scaled
from tests.peer.optim.test_model_buffers import loss, make_model


def test_a_diloco_pair_under_centered_clip_ends_with_one_model() -> None:
    rounds, h = 3, 4
    first = Node(gossip_period=0.2)
    nodes = [first, Node(first.visible_addresses, gossip_period=0.2)]
    models = [make_model() for _ in nodes]
    opts: list[DiLoCo] = []
    try:
        assert wait_until(lambda: all(len(n.members()) == 2 for n in nodes), scaled(15))
        opts = [
            DiLoCo(
                node=node,
                run_id="pair",
                params=model.parameters(),
                buffers=model_buffers(model),
                inner_optimizer=partial(torch.optim.AdamW, lr=1e-2),
                inner_steps=h,
                batch_size_per_step=16,
                matchmaking_time=scaled(1.0),
                aggregator="centered_clip",
                relative_weight_bound=16.0,
                averager_opts={"target_group_size": 2},
                load_state_timeout=scaled(5),
            )
            for node, model in zip(nodes, models, strict=True)
        ]
        assert wait_until(lambda: all(o.tracker.others_reporting() == 1 for o in opts), scaled(15))

        def train(rank: int) -> None:
            for step in range(rounds * h):
                loss(models[rank], rank, step).backward()
                opts[rank].step(batch_size=16)
                opts[rank].zero_grad()

        threads = [threading.Thread(target=train, args=(r,)) for r in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(scaled(120))
        assert not any(t.is_alive() for t in threads)
        assert [(o.outer_step, o.rounds_failed) for o in opts] == [(rounds, 0)] * 2
        for a, b in zip(models[0].parameters(), models[1].parameters(), strict=True):
            assert torch.equal(a.detach(), b.detach())  # under the pair rule: about 0.3 apart
    finally:
        for o in opts:
            o.shutdown()
        for node in nodes:
            node.shutdown()
