"""Averaging that one bad contribution cannot take over: weights declared in matchmaking and
bounded relative to the group, overflowing sums blamed on their cause, and the robust
aggregators (trimmed mean, CenteredClip), down to eight peers training the digits task
while one of them sends adversarial updates.

The swarms here are in-process nodes over the in-memory transport, on one event loop."""

from __future__ import annotations

import contextlib
import functools
import logging
import math
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

from peer import DecentralizedAverager, Node
from peer.averaging.allreduce.reducer import WeightedMeanReducer
from peer.averaging.allreduce.robust import (
    aggregate,
    centered_clip,
    default_trim,
    median,
    outliers,
    trimmed_mean,
    weight_bound,
)
from peer.averaging.allreduce.round import ButterflyRound
from peer.averaging.allreduce.runner import AllreduceRunner
from peer.averaging.exceptions import BadContribution
from peer.node.node import LoopThread
from peer.optim.collaborative.optimizer import Optimizer
from peer.tasks.digits import (
    DigitsData,
    accuracy,
    endless_batches,
    load_digits_split,
    make_model,
    shard_indices,
)
from peer.transport.memory import MemoryNetwork
from swarmlab.averager_doubles import averager_with
from tests.peer.averaging.conftest import step_all, wait_for

# ------------------------------------------------------------------ pure functions


def test_trimmed_mean_drops_the_extremes_of_each_coordinate() -> None:
    values = torch.tensor([[1.0, -100.0], [2.0, 2.0], [3.0, 4.0], [1e9, 6.0], [4.0, 8.0]])
    # one at each end of every coordinate: [1, 2, 3, 4, 1e9] → mean(2, 3, 4)
    assert trimmed_mean(values, trim=1).tolist() == [3.0, 4.0]
    assert trimmed_mean(values, trim=0).tolist() == values.mean(dim=0).tolist()
    assert [default_trim(n) for n in (1, 2, 3, 4, 8, 9)] == [0, 0, 1, 1, 2, 2]
    with pytest.raises(ValueError, match="cannot trim"):
        trimmed_mean(values, trim=3)
    with pytest.raises(ValueError):
        trimmed_mean(torch.zeros(0, 2))


def test_centered_clip_moves_at_most_tau_towards_one_contribution() -> None:
    g = torch.Generator().manual_seed(0)
    honest = torch.randn(7, 50, generator=g) * 0.1 + 1.0
    attacker = torch.full((1, 50), -1e6)
    result = centered_clip(torch.cat([honest, attacker]))
    assert (result - honest.mean(dim=0)).norm() < 0.5, "one outlier cannot drag it far"
    # without clipping (tau infinite in effect) it is the weighted mean, from any start
    pair = torch.tensor([[0.0, 0.0], [3.0, 6.0]])
    out = centered_clip(pair, [2.0, 1.0], tau=1e9, iterations=1, center=torch.zeros(2))
    assert torch.allclose(out, torch.tensor([1.0, 2.0])), out
    # tau = 0: stays at the start, the coordinate-wise median
    assert centered_clip(honest, tau=0.0).tolist() == honest.median(dim=0).values.tolist()
    for bad in ([1.0], [-1.0, 1.0], [0.0, 0.0], [math.nan, 1.0]):
        with pytest.raises(ValueError):
            centered_clip(pair, bad)
    assert aggregate("mean", pair, [2.0, 1.0]).tolist() == [1.0, 2.0]
    with pytest.raises(ValueError, match="unknown aggregator"):
        aggregate("median", pair, [1.0, 1.0])


def test_the_weight_bound_is_a_factor_of_the_lower_median() -> None:
    assert weight_bound([3.0, 3.0, 1e30], 10.0) == 30.0
    assert weight_bound([3.0, 1e30], 10.0) == 30.0, "of two, the heavier cannot set it"
    assert weight_bound([0.0, 0.0, 4.0, 8.0], 2.0) == 8.0, "zero weights do not count"
    assert weight_bound([3.0, 1e30], None) == math.inf
    assert weight_bound([0.0], 2.0) == math.inf


# ------------------------------------------------------------------------ reducer


def test_a_robust_reducer_aggregates_each_complete_part() -> None:
    senders = ["a", "b", "c", "d", "e"]
    r = WeightedMeanReducer([3, 2], senders, aggregator="trimmed_mean")
    for i, s in enumerate(senders[:4]):
        assert r.accumulate(s, 0, torch.full((3,), float(i))) == []
    (done,) = r.accumulate("e", 0, torch.full((3,), 1e9))
    # [0, 1, 2, 3, 1e9], one trimmed at each end → mean(1, 2, 3)
    assert done.average.tolist() == [2.0, 2.0, 2.0] and done.senders == set(senders)
    # a NaN contribution is found without a sum: its sender is excluded and named
    for s in senders[:4]:
        r.accumulate(s, 1, torch.ones(2))
    (done,) = r.accumulate("e", 1, torch.tensor([math.nan, 1.0]))
    assert [o.sender for o in r.take_rejected()] == ["e"]
    assert done.average.tolist() == [1.0, 1.0] and "e" not in done.senders
    with pytest.raises(ValueError, match="aggregator"):
        WeightedMeanReducer([1], ["a"], aggregator="median")
    # values near float32's largest: their aggregate does not overflow
    for name in ("trimmed_mean", "centered_clip"):
        big = WeightedMeanReducer([2], ["a", "b"], aggregator=name)
        big.accumulate("a", 0, torch.tensor([3e38, -3e38]))
        (done,) = big.accumulate("b", 0, torch.tensor([3e38, -3e38]))
        assert done.average.tolist() == torch.tensor([3e38, -3e38]).tolist(), name


def test_a_weight_other_than_the_declared_one_is_refused() -> None:
    r = WeightedMeanReducer([2], ["a", "b"], declared={"a": 2.0, "b": 1.0})
    with pytest.raises(BadContribution, match="differs from the 1 it declared"):
        r.accumulate("b", 0, torch.ones(2), weight=50.0)
    r.accumulate("a", 0, torch.ones(2), weight=2.0)
    (done,) = r.accumulate("b", 0, torch.zeros(2), weight=1.0)
    assert torch.allclose(done.average, torch.full((2,), 2 / 3)), done.average


# -------------------------------------------------------- swarms over memory


@contextlib.contextmanager
def memory_swarm(n: int, gossip_period: float = 0.1) -> Iterator[list[Node]]:
    """``n`` nodes on one event loop over an in-memory network, all knowing each other."""
    loop = LoopThread()
    network = MemoryNetwork()
    nodes: list[Node] = []
    try:
        for i in range(n):
            peers = nodes[0].visible_addresses if nodes else None
            transport = network.transport(f"h{i}")
            nodes.append(
                Node(peers, transport=transport, loop_thread=loop, gossip_period=gossip_period)
            )
        assert wait_for(lambda: all(len(node.members()) == n for node in nodes), 15)
        yield nodes
    finally:
        for node in nodes:
            with contextlib.suppress(Exception):
                node.shutdown()
        loop.stop()


def averagers(
    nodes: list[Node],
    tensors: list[list[torch.Tensor]],
    *,
    averager_class: type[DecentralizedAverager] = DecentralizedAverager,
    **kwargs: Any,
) -> list[Any]:
    n = len(nodes[0].members())
    options: dict[str, Any] = dict(
        start=True, min_matchmaking_time=0.1, target_group_size=n, min_group_size=n
    )
    options.update(kwargs)
    return [averager_class(t, node, **options) for node, t in zip(nodes, tensors, strict=True)]


class _LyingRound(ButterflyRound):
    """Declares one weight in matchmaking, sends its parts with another."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.weight = self.sending.weight = 1000.0


class _LyingRunner(AllreduceRunner):
    round_class = _LyingRound


def test_a_sender_cannot_take_over_the_mean_by_weight_or_overflow(caplog) -> None:
    """Three peers; the third attacks in turn: it declares 1000 times the others' weight, sends
    values whose weighted sum overflows float32, and sends a weight it did not declare.
    Each time it is excluded and named, and the honest two end on their own mean, finite."""
    with memory_swarm(3) as nodes:
        tensors = [[torch.zeros(4000)] for _ in range(3)]
        options = dict(prefix="attack", relative_weight_bound=10.0, part_size_bytes=4096)
        group = averagers(nodes[:2], tensors[:2], **options)
        lying = False  # from the third attack on, its rounds send a weight it did not declare

        def attacker_runner(*args: Any, **kwargs: Any) -> AllreduceRunner:
            return (_LyingRunner if lying else AllreduceRunner)(*args, **kwargs)

        # the attacker reduces nothing: every span is an honest reducer's
        attacker_class = averager_with(runner=attacker_runner)
        group += averagers(
            nodes[2:], tensors[2:], averager_class=attacker_class, bandwidth=0.0, **options
        )
        attacker = group[2]
        g = torch.Generator().manual_seed(1)
        attacks: list[tuple[str, float, float | None]] = [
            ("declared weight 3000 is over the bound of 30", 3000.0, None),
            ("overflow the sum", 3.0, 3e38),
            ("differs from the 3 it declared", 3.0, None),
        ]
        try:
            for why, weight, value in attacks:
                for t in tensors[:2]:
                    t[0].copy_(torch.randn(4000, generator=g))
                honest_mean = (tensors[0][0] + tensors[1][0]) / 2
                tensors[2][0].copy_(torch.full((4000,), value) if value else -honest_mean)
                lying = why.startswith("differs")
                caplog.clear()
                with caplog.at_level(logging.WARNING, logger="peer.averaging"):
                    results = step_all(
                        group,
                        [
                            {"weight": 3.0},
                            {"weight": 3.0},
                            {"weight": weight, "allow_retries": False},
                        ],
                    )
                for i in (0, 1):
                    assert isinstance(results[i], dict), (why, results[i])
                    assert torch.isfinite(tensors[i][0]).all(), why
                    gap = float((tensors[i][0] - honest_mean).abs().max())
                    assert gap < 1e-5, (why, gap)
                named = [
                    r.getMessage() for r in caplog.records if attacker.peer_id in r.getMessage()
                ]
                assert named and all(why in m for m in named), (why, named)
        finally:
            for averager in group:
                averager.shutdown()


def _train_digits(
    data: DigitsData, average: Callable[[list[torch.Tensor]], torch.Tensor], attacker: int | None
) -> float:
    """Eight peers train the digits MLP (:func:`make_model`) by local SGD: each round every
    peer takes 10 steps on its shard from the shared model, ``average`` combines the
    updates (``attacker`` sends its own scaled by -20), and every peer applies the result.
    Returns the test accuracy of the model the honest peers end on. The peers' local steps
    run as one batched computation (one row of parameters per peer)."""
    model = make_model(seed=0)
    hidden = model[0].out_features
    n, features, classes = 8, model[0].in_features, model[2].out_features
    shards = [shard_indices(len(data.y_train), n, i) for i in range(n)]
    streams = [
        endless_batches(data.x_train[s], data.y_train[s], 32, torch.Generator().manual_seed(i))
        for i, s in enumerate(shards)
    ]
    # parameters_to_vector's layout: W1 [hidden, features], b1, W2 [classes, hidden], b2
    cuts = [hidden * features, hidden, classes * hidden, classes]
    shared = torch.nn.utils.parameters_to_vector(model.parameters()).detach().clone()
    for _ in range(8):
        local = shared.repeat(n, 1)  # [peers, size]
        for _ in range(10):
            batch = [next(stream) for stream in streams]
            xb = torch.stack([x for x, _ in batch])  # [peers, 32, features]
            yb = torch.stack([y for _, y in batch])  # [peers, 32]
            local.requires_grad_(True)
            w1, b1, w2, b2 = local.split(cuts, dim=1)
            h = torch.relu(
                torch.baddbmm(b1.unsqueeze(1), xb, w1.view(n, hidden, features).transpose(1, 2))
            )
            logits = torch.baddbmm(b2.unsqueeze(1), h, w2.view(n, classes, hidden).transpose(1, 2))
            # the sum of every peer's mean loss: each row's gradient is that peer's own
            loss = (
                torch.nn.functional.cross_entropy(
                    logits.reshape(-1, classes), yb.reshape(-1), reduction="sum"
                )
                / yb.shape[1]
            )
            (grad,) = torch.autograd.grad(loss, local)
            local = (local - 0.5 * grad).detach()
        updates = list(local - shared)
        if attacker is not None:
            updates[attacker] = updates[attacker] * -20.0
        shared += average(updates)
    torch.nn.utils.vector_to_parameters(shared, model.parameters())
    return accuracy(model, data.x_test, data.y_test)


def _averaged_by(group: list[Any], tensors: list[list[torch.Tensor]], attacker: int) -> Any:
    """A round of ``group`` over ``tensors``: what the honest peers all end on."""

    def average(updates: list[torch.Tensor]) -> torch.Tensor:
        for t, update in zip(tensors, updates, strict=True):
            t[0].copy_(update)
        results = step_all(group, [{"timeout": 10.0}] * len(group))
        assert all(isinstance(r, dict) and len(r) == 8 for r in results), results
        honest = [t[0] for i, t in enumerate(tensors) if i != attacker]
        assert all(torch.equal(honest[0], u) for u in honest), "one average for everyone"
        return honest[0]

    return average


def test_eight_peers_train_digits_while_one_sends_adversarial_updates() -> None:
    """Peer 7 sends its updates scaled by -20. With CenteredClip, the averaged run ends
    within 3 accuracy points of a clean run (the exact mean of honest updates, computed
    here); with the averagers' plain mean, the same attack spoils the model."""
    data = load_digits_split(seed=0)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny tensors: more threads only fight the event loop's
    try:
        clean = _train_digits(data, lambda updates: torch.stack(updates).mean(0), None)
        attacked, spoiled = _attacked_runs(data)
    finally:
        torch.set_num_threads(threads)
    assert clean > 0.9, clean
    assert attacked > clean - 0.03, (attacked, clean)
    assert spoiled < 0.5, (spoiled, clean)


def _attacked_runs(data: DigitsData) -> tuple[float, float]:
    """The accuracies with peer 7 attacking: with CenteredClip, and with the mean."""
    with memory_swarm(8, gossip_period=0.3) as nodes:
        size = sum(p.numel() for p in make_model(seed=0).parameters())
        tensors = [[torch.zeros(size)] for _ in nodes]
        plain = averagers(nodes, tensors, prefix="mean")
        robust = averagers(nodes, tensors, prefix="robust", aggregator="centered_clip")
        try:
            attacked = _train_digits(data, _averaged_by(robust, tensors, 7), attacker=7)
            spoiled = _train_digits(data, _averaged_by(plain, tensors, 7), attacker=7)
        finally:
            for averager in plain + robust:
                averager.shutdown()
    return attacked, spoiled


def test_the_collaborative_optimizer_passes_the_options_to_its_averagers() -> None:
    model = torch.nn.Linear(4, 1)
    with Node(gossip_period=0.2) as node:
        common: dict[str, Any] = dict(
            node=node,
            run_id="robust",
            target_batch_size=8,
            optimizer=functools.partial(torch.optim.SGD, lr=0.1),
            params=list(model.parameters()),
            auxiliary=True,  # (else it first looks for a peer to load the state from)
        )
        with pytest.raises(ValueError, match="aggregator must be one of"):
            Optimizer(**common, aggregator="median")
        opt = Optimizer(**common, aggregator="trimmed_mean", relative_weight_bound=5.0)
        try:
            for averager in (opt.grad_averager, opt.state_averager):
                config = averager.allreduce_config
                assert (config.aggregator, config.relative_weight_bound) == ("trimmed_mean", 5.0)
        finally:
            opt.shutdown()


def test_centered_clip_of_an_honest_group_is_its_weighted_mean() -> None:
    """Honest contributions lie at similar distances: none is clipped, and the aggregate is
    the weighted mean (a run pays nothing for the protection). Two start from their midpoint,
    the median of an even count; an outlier among three or more is reported."""
    g = torch.Generator().manual_seed(3)
    for n in (2, 3, 4, 8):
        values = torch.randn(n, 1000, generator=g, dtype=torch.float64)
        weights = torch.rand(n, generator=g, dtype=torch.float64) + 0.5
        mean = (values * weights.unsqueeze(1)).sum(0) / weights.sum()
        out = centered_clip(values, weights)
        assert torch.allclose(out, mean, atol=1e-12), n
        assert outliers(values, out) == [], n
    assert median(torch.tensor([[0.0], [3.0]])).tolist() == [1.5]
    attacked = torch.cat([torch.randn(3, 1000, generator=g), torch.full((1, 1000), 1e37)])
    (row, ratio), *more = outliers(attacked, centered_clip(attacked))
    assert (row, more) == (3, []) and ratio > 1e30


def test_a_straggler_among_equal_states_is_not_an_outlier() -> None:
    """Three members hold the same model and one is a step behind (the collaborative
    optimizer's state rounds): the median distance is 0, but the straggler is close to the
    model's own size, so it is not named; values of 1e37 are."""
    g = torch.Generator().manual_seed(4)
    model = torch.randn(1000, generator=g)
    behind = model + 0.01 * torch.randn(1000, generator=g)
    states = torch.stack([model, model, model, behind])
    assert torch.equal(centered_clip(states), model), "the members that agree hold the result"
    assert outliers(states, centered_clip(states)) == []
    states[3] = 1e37
    assert [row for row, _ in outliers(states, centered_clip(states))] == [3]
