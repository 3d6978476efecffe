"""DiLoCo in one process: peers on threads over loopback, checked against hand-computed
outer steps; its options' errors."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

from peer import DiLoCo, Node
from peer.testing import wait_until
from tests.conftest import scaled


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))


def batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * step + rank)
    x = torch.randn(8, 4, generator=g)
    return x, x.sum(dim=1, keepdim=True).sin()


def inner(params: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-2)


def outer(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.7, momentum=0.9, nesterov=True)


@pytest.fixture
def nodes() -> Iterator[Callable[[int], list[Node]]]:
    made: list[Node] = []

    def make(n: int) -> list[Node]:
        first = Node(gossip_period=0.2)
        made.append(first)
        for _ in range(1, n):
            made.append(Node(first.visible_addresses, gossip_period=0.2))
        assert wait_until(lambda: all(len(x.members()) == n for x in made), scaled(15))
        return made

    yield make
    for node in made:
        node.shutdown()


def _train(opt: DiLoCo, model: torch.nn.Module, rank: int, steps: int, sizes: list[int]) -> None:
    for step in range(steps):
        x, y = batch(rank, step)
        x, y = x[: sizes[rank]], y[: sizes[rank]]
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step(batch_size=sizes[rank])
        opt.zero_grad()


def _reference(peers: int, rounds: int, h: int, sizes: list[int]) -> list[torch.Tensor]:
    """DiLoCo by hand: each peer's H AdamW steps from the round's start, the weighted mean
    pseudo-gradient, one Nesterov SGD step on the outer parameters."""
    start = [p.detach().clone() for p in make_model().parameters()]
    global_model = make_model()
    outer_opt = outer(global_model.parameters())
    models = [make_model() for _ in range(peers)]
    inners = [inner(m.parameters()) for m in models]
    step = 0
    for _ in range(rounds):
        deltas = []
        for rank, (m, opt) in enumerate(zip(models, inners, strict=True)):
            with torch.no_grad():
                for p, s in zip(m.parameters(), start, strict=True):
                    p.copy_(s)
            for k in range(h):
                x, y = batch(rank, step + k)
                x, y = x[: sizes[rank]], y[: sizes[rank]]
                torch.nn.functional.mse_loss(m(x), y).backward()
                opt.step()
                opt.zero_grad()
            deltas.append([s - p.detach() for s, p in zip(start, m.parameters(), strict=True)])
        step += h
        total = float(sum(sizes))
        for i, p in enumerate(global_model.parameters()):
            p.grad = sum(d[i] * (sizes[r] / total) for r, d in enumerate(deltas))
        outer_opt.step()
        start = [p.detach().clone() for p in global_model.parameters()]
    return start


def test_one_group_without_compression_takes_the_outer_step_on_the_mean(
    nodes: Callable[[int], list[Node]],
) -> None:
    peers, rounds, h, sizes = 3, 3, 4, [8, 5, 3]
    swarm = nodes(peers)
    models = [make_model() for _ in range(peers)]
    opts = [
        DiLoCo(
            node=node,
            run_id="diloco-exact",
            params=m.parameters(),
            inner_optimizer=inner,
            inner_steps=h,
            outer_optimizer=outer,
            matchmaking_time=scaled(1.0),
            averager_opts={"target_group_size": peers},
            load_state_timeout=scaled(5),
        )
        for node, m in zip(swarm, models, strict=True)
    ]
    # every peer sees the others' reports before training (else it would train alone)
    assert wait_until(
        lambda: all(o.tracker.others_reporting() == peers - 1 for o in opts), scaled(15)
    )
    threads = [
        threading.Thread(target=_train, args=(o, m, r, rounds * h, sizes))
        for r, (o, m) in enumerate(zip(opts, models, strict=True))
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(scaled(120))
    try:
        expected = _reference(peers, rounds, h, sizes)
        for o, m in zip(opts, models, strict=True):
            assert o.outer_step == rounds
            assert (o.rounds_done, o.rounds_failed, o.last_group_size) == (rounds, 0, peers)
            for mine, ref in zip(m.parameters(), expected, strict=True):
                torch.testing.assert_close(mine.detach(), ref, atol=1e-6, rtol=0)
    finally:
        for o in opts:
            o.shutdown()


def test_a_lone_peer_applies_its_own_pseudo_gradient(nodes: Callable[[int], list[Node]]) -> None:
    (node,) = nodes(1)
    model = make_model()
    opt = DiLoCo(
        node=node,
        run_id="diloco-lone",
        params=model.parameters(),
        inner_optimizer=inner,
        inner_steps=3,
        outer_optimizer=outer,
        matchmaking_time=scaled(0.5),
        load_state_timeout=scaled(2),
    )
    try:
        _train(opt, model, 0, 6, [8])
        assert opt.outer_step == 2 and opt.rounds_done == 0
        expected = _reference(1, 2, 3, [8])
        for mine, ref in zip(model.parameters(), expected, strict=True):
            torch.testing.assert_close(mine.detach(), ref, atol=1e-6, rtol=0)
        state = opt.state_dict()
        assert state["sync"] == 2 and state["steps"] == 0
    finally:
        opt.shutdown()


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"inner_steps": 0}, "inner_steps"),
        ({"fragments": 0}, "fragments"),
        ({"fragments": 5, "inner_steps": 4}, "fragments cannot exceed"),
        ({"fragments": 9, "inner_steps": 20}, "parameter tensors"),
        ({"compression": "int3"}, "unknown compression"),
        ({"matchmaking_time": -1.0}, "matchmaking_time"),
        ({"run_id": ""}, "run_id"),
    ],
)
def test_bad_options_are_refused_with_the_reason(
    nodes: Callable[[int], list[Node]], kwargs: dict[str, Any], message: str
) -> None:
    (node,) = nodes(1)
    model = make_model()
    options: dict[str, Any] = dict(
        node=node,
        run_id="diloco-bad",
        params=model.parameters(),
        inner_optimizer=inner,
        inner_steps=4,
    )
    options.update(kwargs)
    with pytest.raises(ValueError, match=message):
        DiLoCo(**options)


def test_an_optimizer_instance_is_refused_for_a_factory(
    nodes: Callable[[int], list[Node]],
) -> None:
    (node,) = nodes(1)
    model = make_model()
    with pytest.raises(TypeError, match="factory"):
        DiLoCo(
            node=node,
            run_id="diloco-bad",
            params=model.parameters(),
            inner_optimizer=torch.optim.SGD(model.parameters(), lr=0.1),  # type: ignore[arg-type]
            inner_steps=4,
        )
