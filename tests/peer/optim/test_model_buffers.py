"""A model's buffers (batch-norm running statistics, ``num_batches_tracked``) shared by the
swarm optimizers: averaged as values, integer ones kept integers, handed to newcomers, and
in the state a volunteer checkpoints and evaluates.

The pieces without sockets first; then three peers in one process over loopback training a
BatchNorm MLP on scikit-learn's digits with the collaborative optimizer and with DiLoCo.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from functools import partial
from typing import Any

import pytest
import torch

from peer import DiLoCo, Node
from peer.optim import model_buffers
from peer.optim.buffers import ModelBuffers
from peer.optim.collaborative.optimizer import Optimizer
from peer.optim.shared.live_state import LiveState
from peer.tasks.base import TrainingConfig
from peer.tasks.digits import load_digits_split
from swarmlab.node_process import wait_until
from tests.conftest import scaled

# ------------------------------------------------------------------ the model and data


def make_model() -> torch.nn.Module:
    """64 → 32 → BatchNorm → 10: two float buffers and an int64 ``num_batches_tracked``."""
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(64, 32),
        torch.nn.BatchNorm1d(32),
        torch.nn.ReLU(),
        torch.nn.Linear(32, 10),
    )


DATA = load_digits_split(seed=0)


def batch(rank: int, step: int, size: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    """Peer ``rank``'s batch ``step``: its own samples, so its statistics are its own."""
    g = torch.Generator().manual_seed(1000 * rank + step)
    pick = torch.randint(0, len(DATA.y_train), (size,), generator=g)
    # each peer sees its inputs shifted differently: local running means differ visibly
    return DATA.x_train[pick] + 0.5 * rank, DATA.y_train[pick]


def loss(model: torch.nn.Module, rank: int, step: int) -> torch.Tensor:
    x, y = batch(rank, step)
    return torch.nn.functional.cross_entropy(model(x), y)


def accuracy(model: torch.nn.Module) -> float:
    was = model.training
    model.eval()
    try:
        with torch.no_grad():
            return float((model(DATA.x_test).argmax(1) == DATA.y_test).float().mean())
    finally:
        model.train(was)


def bn(model: torch.nn.Module) -> torch.nn.BatchNorm1d:
    layer = model[1]
    assert isinstance(layer, torch.nn.BatchNorm1d)
    return layer


def assert_same_state(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for key in a:
        assert a[key].dtype == b[key].dtype, key
        torch.testing.assert_close(a[key], b[key], atol=1e-6, rtol=0, msg=key)


# ------------------------------------------------------------------ pieces, no sockets


def test_model_buffers_are_the_persistent_numeric_ones_each_once() -> None:
    model = make_model()
    model.register_buffer("mask", torch.ones(3, dtype=torch.bool))  # a constant
    model.register_buffer("cache", torch.zeros(4), persistent=False)  # rebuilt by the model
    model.alias = model[1]  # the same BatchNorm twice: its buffers once
    found = model_buffers(model)
    layer = bn(model)
    assert [id(b) for b in found] == [
        id(layer.running_mean),
        id(layer.running_var),
        id(layer.num_batches_tracked),
    ]


def test_integer_buffers_travel_as_floats_and_come_back_rounded_in_their_dtype() -> None:
    model = make_model()
    layer = bn(model)
    buffers = ModelBuffers(model_buffers(model))
    assert all(v.dtype == torch.float32 and v.device.type == "cpu" for v in buffers.shared)
    layer.num_batches_tracked.fill_(7)
    layer.running_mean.fill_(0.25)
    buffers.read()
    assert buffers.shared[2].item() == 7.0 and buffers.shared[0][0].item() == 0.25
    # a round's mean of 7, 8 and 8 counts
    buffers.shared[2].fill_(23 / 3)
    buffers.shared[0].fill_(0.5)
    buffers.write()
    assert layer.num_batches_tracked.dtype == torch.int64
    assert layer.num_batches_tracked.item() == 8
    assert torch.equal(layer.running_mean, torch.full((32,), 0.5))
    values = buffers.state_values()
    assert values[2].dtype == torch.int64 and values[2].item() == 8


def test_a_bool_buffer_is_refused_with_the_reason() -> None:
    with pytest.raises(TypeError, match="bool"):
        ModelBuffers([torch.ones(2, dtype=torch.bool)])


def test_the_live_state_lists_the_buffers_after_the_optimizer_and_loads_them_back() -> None:
    model = make_model()
    live = LiveState(
        partial(torch.optim.SGD, lr=0.1, momentum=0.9),
        model.parameters(),
        offload=False,
        buffers=ModelBuffers(model_buffers(model)),
    )
    tensors = live.tensors()
    params = list(model.parameters())
    # parameters, SGD's momentum buffers, then running mean, running var, count
    assert len(tensors) == 2 * len(params) + 3
    incoming = [t.clone() for t in tensors]
    incoming[-3].fill_(1.5)
    incoming[-1].fill_(41.6)
    live.load(incoming)
    layer = bn(model)
    assert torch.equal(layer.running_mean, torch.full((32,), 1.5))
    assert layer.num_batches_tracked.dtype == torch.int64
    assert layer.num_batches_tracked.item() == 42
    # a state of a model without these buffers does not fit
    with pytest.raises(ValueError, match="does not match"):
        live.load(incoming[:-3])


class Tied(torch.nn.Module):
    """An embedding whose matrix is also the output layer's, with a BatchNorm between."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = torch.nn.Embedding(10, 8)
        self.norm = torch.nn.BatchNorm1d(8)
        self.out = torch.nn.Linear(8, 10, bias=False)
        self.out.weight = self.emb.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.norm(self.emb(x)))


def test_tied_weights_stay_one_tensor_through_a_state_load_and_load_state_dict() -> None:
    model = Tied()
    live = LiveState(
        partial(torch.optim.SGD, lr=0.1),
        model.parameters(),
        offload=False,
        buffers=ModelBuffers(model_buffers(model)),
    )
    # one tied parameter, the BatchNorm's two, then its three buffers
    assert len(live.tensors()) == 3 + 3
    incoming = [t.clone() + 1.0 for t in live.tensors()]
    live.load(incoming)
    assert model.out.weight is model.emb.weight
    torch.testing.assert_close(model.emb.weight.detach(), incoming[0])
    state = model.state_dict()
    assert {"emb.weight", "out.weight"} <= set(state)
    fresh = Tied()
    fresh.load_state_dict(state, strict=True)
    assert fresh.out.weight is fresh.emb.weight
    torch.testing.assert_close(fresh.out.weight.detach(), incoming[0])


def test_local_buffers_keeps_them_out_of_the_optimizer(monkeypatch: pytest.MonkeyPatch) -> None:
    import peer.optim.collaborative.optimizer as collaborative

    seen: dict[str, Any] = {}

    def record(**kwargs: Any) -> None:
        seen.update(kwargs)

    monkeypatch.setattr(collaborative, "Optimizer", record)
    model = make_model()
    config = TrainingConfig(target_batch_size=64, batch_size=16, optimizer="sgd", lr=0.1)
    config.make_swarm_optimizer(None, "run", model.parameters(), buffers=model_buffers(model))  # type: ignore[arg-type]
    assert len(seen["buffers"]) == 3
    local = TrainingConfig(
        target_batch_size=64, batch_size=16, optimizer="sgd", lr=0.1, local_buffers=True
    )
    local.make_swarm_optimizer(None, "run", model.parameters(), buffers=model_buffers(model))  # type: ignore[arg-type]
    assert seen["buffers"] is None
    with pytest.raises(ValueError, match="local_buffers"):
        TrainingConfig(
            target_batch_size=64, batch_size=16, optimizer="sgd", lr=0.1, local_buffers="yes"
        )  # type: ignore[arg-type]


# ------------------------------------------------------------------ swarms in one process


@pytest.fixture
def nodes() -> Iterator[Callable[[int], list[Node]]]:
    made: list[Node] = []

    def make(n: int) -> list[Node]:
        first = made[0] if made else None
        fresh = []
        for _ in range(n):
            if first is None:
                first = Node(gossip_period=0.2)
                fresh.append(first)
            else:
                fresh.append(Node(first.visible_addresses, gossip_period=0.2))
        made.extend(fresh)
        assert wait_until(lambda: all(len(x.members()) == len(made) for x in made), scaled(15))
        return fresh

    yield make
    for node in reversed(made):
        node.shutdown()


def _run_threads(targets: list[Callable[[], None]]) -> None:
    errors: list[BaseException] = []

    def guarded(target: Callable[[], None]) -> None:
        try:
            target()
        except BaseException as exc:  # reported in the test's thread
            errors.append(exc)

    threads = [threading.Thread(target=guarded, args=(t,)) for t in targets]
    for t in threads:
        t.start()
    for t in threads:
        t.join(scaled(180))
    assert not any(t.is_alive() for t in threads), "a peer did not finish"
    assert not errors, errors


def _check_swarm(models: list[torch.nn.Module], states: list[dict[str, torch.Tensor]]) -> None:
    """Every peer's model and checkpoint state agree; the checkpoint loads strictly into a
    fresh model and evaluates to the figure each peer's model gives."""
    first = states[0]
    for state in states[1:]:
        assert_same_state(first, state)
    counts = [s["1.num_batches_tracked"] for s in states]
    assert all(c.dtype == torch.int64 for c in counts)
    assert len({int(c) for c in counts}) == 1 and int(counts[0]) > 0
    fresh = make_model()
    fresh.load_state_dict(first, strict=True)
    figure = accuracy(fresh)
    for model in models:
        assert accuracy(model) == pytest.approx(figure, abs=1e-9)
    # the statistics are the swarm's, not a fresh layer's (nor any one peer's data)
    assert not torch.allclose(first["1.running_mean"], torch.zeros(32), atol=1e-3)


def test_collaborative_peers_end_with_the_same_parameters_and_buffers_and_a_newcomer_gets_them(
    nodes: Callable[[int], list[Node]],
) -> None:
    peers, epochs = 3, 4
    swarm = nodes(peers)
    models = [make_model() for _ in range(peers)]

    def make_opt(node: Node, model: torch.nn.Module) -> Optimizer:
        return Optimizer(
            node=node,
            run_id="buffers-collab",
            target_batch_size=16 * peers,
            batch_size_per_step=16,
            optimizer=partial(torch.optim.SGD, lr=0.1, momentum=0.9),
            params=model.parameters(),
            buffers=model_buffers(model),
            matchmaking_time=scaled(1.0),
            averager_opts={"target_group_size": peers},
            load_state_timeout=scaled(5),
        )

    opts = [make_opt(node, m) for node, m in zip(swarm, models, strict=True)]
    newcomer: Optimizer | None = None
    try:
        assert wait_until(
            lambda: all(o.tracker.others_reporting() == peers - 1 for o in opts), scaled(15)
        )

        def train(rank: int) -> None:
            opt, model, step = opts[rank], models[rank], 0
            while opt.local_epoch < epochs:
                loss(model, rank, step).backward()
                opt.step(batch_size=16)
                opt.zero_grad()
                step += 1

        _run_threads([partial(train, r) for r in range(peers)])
        assert all(o.local_epoch == epochs for o in opts)
        states = [o.synchronised_state_dict(m) for o, m in zip(opts, models, strict=True)]
        # the model itself holds the swarm's buffers after the epoch's state round
        for m, s in zip(models, states, strict=True):
            assert_same_state({k: v.detach().cpu() for k, v in m.state_dict().items()}, s)
        _check_swarm(models, states)

        # a newcomer downloads the buffers with the state: its first figure is the swarm's
        (late,) = nodes(1)
        model = make_model()
        newcomer = make_opt(late, model)
        assert newcomer.local_epoch == epochs
        assert_same_state({k: v.detach() for k, v in model.state_dict().items()}, states[0])
        assert accuracy(model) == pytest.approx(accuracy(models[0]), abs=1e-9)
    finally:
        for o in [*opts, *([newcomer] if newcomer is not None else [])]:
            o.shutdown()


def test_diloco_peers_share_the_outer_buffers_each_round_and_a_newcomer_gets_them(
    nodes: Callable[[int], list[Node]],
) -> None:
    peers, rounds, h = 3, 2, 4
    swarm = nodes(peers)
    models = [make_model() for _ in range(peers)]

    def make_opt(node: Node, model: torch.nn.Module) -> DiLoCo:
        return DiLoCo(
            node=node,
            run_id="buffers-diloco",
            params=model.parameters(),
            buffers=model_buffers(model),
            inner_optimizer=partial(torch.optim.AdamW, lr=1e-2),
            inner_steps=h,
            batch_size_per_step=16,
            matchmaking_time=scaled(1.0),
            averager_opts={"target_group_size": peers},
            load_state_timeout=scaled(5),
        )

    opts = [make_opt(node, m) for node, m in zip(swarm, models, strict=True)]
    newcomer: DiLoCo | None = None
    try:
        assert wait_until(
            lambda: all(o.tracker.others_reporting() == peers - 1 for o in opts), scaled(15)
        )
        alone = make_model()  # what one peer's statistics would be on its own
        for step in range(rounds * h):
            with torch.no_grad():
                alone(batch(0, step)[0])

        def train(rank: int) -> None:
            for step in range(rounds * h):
                loss(models[rank], rank, step).backward()
                opts[rank].step(batch_size=16)
                opts[rank].zero_grad()

        _run_threads([partial(train, r) for r in range(peers)])
        for o in opts:
            assert (o.outer_step, o.rounds_done, o.rounds_failed) == (rounds, rounds, 0)
        states = [o.synchronised_state_dict(m) for o, m in zip(opts, models, strict=True)]
        _check_swarm(models, states)
        # the uploaded statistics are the swarm's mean (the peers' inputs are shifted by
        # 0, 0.5 and 1: about 0.5 apart from peer 0's own), and the model holds them
        mine = bn(alone).running_mean
        assert (states[0]["1.running_mean"] - mine).abs().mean() > 0.05
        for m, s in zip(models, states, strict=True):
            assert_same_state({k: v.detach().cpu() for k, v in m.state_dict().items()}, s)
        # state_dict carries the outer buffers and load_state_dict restores them
        saved = opts[0].state_dict()
        with torch.no_grad():
            bn(models[0]).running_mean.fill_(9.0)
        opts[0].load_state_dict(saved)
        torch.testing.assert_close(bn(models[0]).running_mean, states[0]["1.running_mean"])

        (late,) = nodes(1)
        model = make_model()
        newcomer = make_opt(late, model)
        assert newcomer.local_epoch == rounds
        assert_same_state({k: v.detach() for k, v in model.state_dict().items()}, states[0])
    finally:
        for o in [*opts, *([newcomer] if newcomer is not None else [])]:
            o.shutdown()


def test_diloco_with_fragments_overlap_and_compression_keeps_the_outer_buffers_together(
    nodes: Callable[[int], list[Node]],
) -> None:
    peers, h, fragments = 2, 4, 2
    swarm = nodes(peers)
    models = [make_model() for _ in range(peers)]
    opts = [
        DiLoCo(
            node=node,
            run_id="buffers-diloco-streaming",
            params=m.parameters(),
            buffers=model_buffers(m),
            inner_optimizer=partial(torch.optim.AdamW, lr=1e-2),
            inner_steps=h,
            fragments=fragments,
            overlap=True,
            compression="int8",
            error_feedback=True,
            batch_size_per_step=16,
            matchmaking_time=scaled(1.0),
            averager_opts={"target_group_size": peers},
            load_state_timeout=scaled(5),
        )
        for node, m in zip(swarm, models, strict=True)
    ]
    try:
        assert wait_until(
            lambda: all(o.tracker.others_reporting() == peers - 1 for o in opts), scaled(15)
        )

        def train(rank: int) -> None:
            for step in range(3 * h):
                loss(models[rank], rank, step).backward()
                opts[rank].step(batch_size=16)
                opts[rank].zero_grad()
            opts[rank].wait_for_pending()

        _run_threads([partial(train, r) for r in range(peers)])
        assert all(o.rounds_failed == 0 and o.rounds_done >= 2 for o in opts)
        first, second = (o.synchronised_state_dict(m) for o, m in zip(opts, models, strict=True))
        for key in ("1.running_mean", "1.running_var", "1.num_batches_tracked"):
            assert torch.equal(first[key], second[key]), key
        assert first["1.num_batches_tracked"].dtype == torch.int64
        # the buffers travel with the last fragment's rounds: they moved off the start
        assert not torch.allclose(first["1.running_mean"], torch.zeros(32), atol=1e-3)
    finally:
        for o in opts:
            o.shutdown()
