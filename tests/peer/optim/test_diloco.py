"""DiLoCo in one process: peers on threads over loopback, checked against hand-computed
outer steps; its options' errors."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

from peer import DiLoCo, Node
from swarmlab.node_process import wait_until
from tests.conftest import scaled

# The swarm's float32 mean adds the peers' values in the order they arrive and the reference
# in peer order: their last bits differ (a few 1e-8), and three outer steps with momentum
# grow that to a few 1e-6. Leaving a peer out of the mean, or weighing the peers equally,
# is off by 2e-2.
MEAN_ORDER_ATOL = 5e-5


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
                torch.testing.assert_close(mine.detach(), ref, atol=MEAN_ORDER_ATOL, rtol=0)
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


def _fragment_reference(
    peers: int, syncs: int, h: int, fragments: list[list[int]], size: int
) -> list[list[torch.Tensor]]:
    """Streaming DiLoCo by hand (equal batch sizes, so the mean is plain): sync k after
    ``steps_before_sync(k)`` more inner steps averages fragment ``k % F``'s pseudo-gradient
    and steps the outer optimizer on that fragment only."""
    from peer.optim.diloco.sync_schedule import steps_before_sync

    global_model = make_model()
    outer_params = list(global_model.parameters())
    outer_opt = outer(outer_params)
    models = [make_model() for _ in range(peers)]
    inners = [inner(m.parameters()) for m in models]
    step = 0
    for k in range(syncs):
        for _ in range(steps_before_sync(k, h, len(fragments))):
            for rank, (m, opt) in enumerate(zip(models, inners, strict=True)):
                x, y = batch(rank, step)
                torch.nn.functional.mse_loss(m(x[:size]), y[:size]).backward()
                opt.step()
                opt.zero_grad()
            step += 1
        indices = fragments[k % len(fragments)]
        for i in indices:
            locals_ = [list(m.parameters())[i].detach() for m in models]
            outer_params[i].grad = sum(outer_params[i].detach() - p for p in locals_) / peers
        outer_opt.step()
        outer_opt.zero_grad(set_to_none=True)
        for m in models:
            with torch.no_grad():
                for i in indices:
                    list(m.parameters())[i].copy_(outer_params[i])
    return [[p.detach().clone() for p in m.parameters()] for m in models]


def _swarm(
    swarm: list[Node], run_id: str, h: int, **kwargs: Any
) -> tuple[list[DiLoCo], list[torch.nn.Module]]:
    models = [make_model() for _ in swarm]
    opts = [
        DiLoCo(
            node=node,
            run_id=run_id,
            params=m.parameters(),
            inner_optimizer=inner,
            inner_steps=h,
            outer_optimizer=outer,
            matchmaking_time=scaled(1.0),
            averager_opts={"target_group_size": len(swarm)},
            load_state_timeout=scaled(5),
            **kwargs,
        )
        for node, m in zip(swarm, models, strict=True)
    ]
    assert wait_until(
        lambda: all(o.tracker.others_reporting() == len(swarm) - 1 for o in opts), scaled(15)
    )
    return opts, models


def _train_all(opts: list[DiLoCo], models: list[torch.nn.Module], steps: int) -> None:
    sizes = [8] * len(opts)
    threads = [
        threading.Thread(target=_train, args=(o, m, r, steps, sizes))
        for r, (o, m) in enumerate(zip(opts, models, strict=True))
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(scaled(120))
    for o in opts:
        assert o.wait_for_pending(timeout=scaled(30))


def test_fragments_sync_in_turn_each_by_the_outer_step_on_its_mean(
    nodes: Callable[[int], list[Node]],
) -> None:
    peers, h, fragments, syncs = 2, 4, 2, 6  # a sync every 2 inner steps, fragments alternate
    opts, models = _swarm(nodes(peers), "diloco-fragments", h, fragments=fragments)
    try:
        assert opts[0].fragments == [[0], [1, 2, 3]]  # 32 | 8 + 8 + 1 elements
        _train_all(opts, models, syncs * h // fragments)
        expected = _fragment_reference(peers, syncs, h, opts[0].fragments, 8)
        for o, m, ref_model in zip(opts, models, expected, strict=True):
            assert o.outer_step == syncs and o.rounds_done == syncs
            # (each peer's fragment synced before the last holds its own progress since)
            for mine, ref in zip(m.parameters(), ref_model, strict=True):
                torch.testing.assert_close(mine.detach(), ref, atol=MEAN_ORDER_ATOL, rtol=0)
    finally:
        for o in opts:
            o.shutdown()


def test_overlapped_compressed_rounds_keep_the_peers_outer_states_together(
    nodes: Callable[[int], list[Node]],
) -> None:
    peers, h = 2, 4
    opts, models = _swarm(
        nodes(peers), "diloco-overlap", h, fragments=2, overlap=True, compression="int8"
    )
    try:
        _train_all(opts, models, 12)
        for o in opts:
            assert o.outer_step == 6 and o.rounds_failed == 0
            assert o.rounds_done == 6 and o.last_group_size == peers
        # a span's reducer keeps what the others decode of its int8 average, not its exact
        # average: every peer applies the same outer update
        for a, b in zip(opts[0].outer_params, opts[1].outer_params, strict=True):
            torch.testing.assert_close(a, b, atol=1e-6, rtol=0)
    finally:
        for o in opts:
            o.shutdown()


def test_an_overlapped_round_lands_merged_with_the_progress_made_meanwhile(
    nodes: Callable[[int], list[Node]],
) -> None:
    (node,) = nodes(1)
    model = make_model()
    opt = DiLoCo(
        node=node,
        run_id="diloco-merge",
        params=model.parameters(),
        inner_optimizer=inner,
        inner_steps=2,
        outer_optimizer=outer,
        fragments=2,
        overlap=True,
        load_state_timeout=scaled(2),
    )
    gate = threading.Event()
    real_round = opt._run_round

    def held_round(run: Any) -> None:
        gate.wait(scaled(30))
        real_round(run)

    opt._run_round = held_round  # type: ignore[method-assign]
    try:
        start = [p.detach().clone() for p in model.parameters()]
        _train(opt, model, 0, 1, [8])  # sync 0 (fragment 0) starts in the background
        assert opt.pending_update
        at_sync = [p.detach().clone() for p in model.parameters()]
        x, y = batch(0, 7)
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.inner_optimizer.step()  # local progress while the round runs (no sync due)
        opt.zero_grad()
        now = [p.detach().clone() for p in model.parameters()]
        gate.set()
        assert opt.wait_for_pending(timeout=scaled(30))
        # lone peer: Nesterov SGD's first step on Δ = start - at_sync is 0.7 * 1.9 * Δ
        for i, p in enumerate(model.parameters()):
            if i in opt.fragments[0]:
                outer_new = start[i] - 0.7 * 1.9 * (start[i] - at_sync[i])
                torch.testing.assert_close(opt.outer_params[i].detach(), outer_new)
                torch.testing.assert_close(p.detach(), outer_new + (now[i] - at_sync[i]))
            else:  # the other fragment is not touched
                torch.testing.assert_close(p.detach(), now[i], atol=0, rtol=0)
        assert opt.outer_step == 1
    finally:
        gate.set()
        opt.shutdown()


def test_state_dict_restores_both_optimizers_the_outer_parameters_and_the_sync(
    nodes: Callable[[int], list[Node]],
) -> None:
    first, second = nodes(2)
    opts = []
    try:
        model = make_model()
        opt = DiLoCo(
            node=first,
            run_id="diloco-state-a",
            params=model.parameters(),
            inner_optimizer=inner,
            inner_steps=3,
            outer_optimizer=outer,
            load_state_timeout=scaled(2),
        )
        opts.append(opt)
        _train(opt, model, 0, 7, [8])  # two syncs, then one inner step towards the third
        state = opt.state_dict()
        assert (state["sync"], state["steps"]) == (2, 1)
        other_model = make_model()
        other = DiLoCo(
            node=second,
            run_id="diloco-state-b",
            params=other_model.parameters(),
            inner_optimizer=inner,
            inner_steps=3,
            outer_optimizer=outer,
            load_state_timeout=scaled(2),
        )
        opts.append(other)
        other.load_state_dict(state)
        assert other.outer_step == 2 and other.state_dict()["steps"] == 1
        for a, b in zip(other.outer_params, opt.outer_params, strict=True):
            assert torch.equal(a, b)
        momentum = [s["momentum_buffer"] for s in opt.outer_optimizer.state.values()]
        restored = [s["momentum_buffer"] for s in other.outer_optimizer.state.values()]
        for a, b in zip(restored, momentum, strict=True):
            assert torch.equal(a, b)
        bad = dict(state, outer_params=state["outer_params"][:-1])
        with pytest.raises(ValueError, match="do not match"):
            other.load_state_dict(bad)
        assert other.outer_step == 2  # nothing changed
    finally:
        for o in opts:
            o.shutdown()
