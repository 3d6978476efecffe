"""DecentralizedSGD/Adam over real nodes (WebSocket on loopback, one process): averaging in
the background, epochs counted across the swarm, catch-up by state download, prompt shutdown,
argument checks."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

from peer import DecentralizedAdam, DecentralizedOptimizer, DecentralizedSGD, Node
from peer.optim.shared.progress import ProgressReport, progress_key
from swarmlab.node_process import wait_until
from tests.conftest import scaled

FAST = {"min_matchmaking_time": 1.0, "request_timeout": 1.0}
NEVER = 10**9  # an averaging period that never comes: rounds only when a test asks


@pytest.fixture
def make_nodes() -> Iterator[Callable[[int], list[Node]]]:
    made: list[Node] = []
    optimizers: list[DecentralizedOptimizer] = []

    def make(n: int) -> list[Node]:
        first = Node(gossip_period=0.2)
        nodes = [first] + [Node(first.visible_addresses, gossip_period=0.2) for _ in range(n - 1)]
        made.extend(nodes)
        assert wait_until(lambda: all(len(x.members()) == n for x in nodes), scaled(15))
        return nodes

    make.optimizers = optimizers  # type: ignore[attr-defined]
    yield make
    for opt in optimizers:
        with contextlib.suppress(Exception):
            opt.shutdown()
    for node in made:
        with contextlib.suppress(Exception):
            node.shutdown()


def model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3))


def local_step(opt: DecentralizedOptimizer, net: torch.nn.Module, seed: int) -> Any:
    g = torch.Generator().manual_seed(seed)
    x, y = torch.randn(8, 6, generator=g), torch.randint(0, 3, (8,), generator=g)
    opt.zero_grad()
    torch.nn.functional.cross_entropy(net(x), y).backward()
    return opt.step(batch_size=8)


def gossiped(node: Node, prefix: str, peer_id: str) -> ProgressReport | None:
    found = node.get(progress_key(prefix))
    if found is None or peer_id not in found.value:
        return None
    return ProgressReport.from_wire(peer_id, found.value[peer_id].value)


def seen_everywhere(nodes: list[Node], opt: DecentralizedOptimizer) -> bool:
    """Every node holds ``opt``'s latest progress (epoch, steps at it, total steps)."""
    want = (opt.local_epoch, opt.steps_at_epoch, opt.local_step)
    for node in nodes:
        r = gossiped(node, opt.config.prefix, opt.node.peer_id)
        if r is None or (r.epoch, r.done_at_epoch, r.done_in_total) != want:
            return False
    return True


@pytest.mark.parametrize("amsgrad", [False, True])
def test_adam_round_leaves_the_group_mean_of_statistics_and_parameters(
    make_nodes, amsgrad: bool
) -> None:
    """Point 5: after a round, exp_avg_sq (max_exp_avg_sq with amsgrad) and parameters on
    every peer equal the mean over the group of the values captured just before it."""
    nodes = make_nodes(4)
    nets = [model(i) for i in range(4)]
    opts = [
        DecentralizedAdam(
            net.parameters(),
            0.05,
            node=node,
            prefix="adam",
            target_group_size=4,
            averaging_steps_period=3,  # the third step asks for the one round
            max_allowed_epoch_difference=1,
            total_steps_in_epoch=1000,
            amsgrad=amsgrad,
            timeout=scaled(30),
            **{**FAST, "min_matchmaking_time": 2.0},
        )
        for net, node in zip(nets, nodes, strict=True)
    ]
    make_nodes.optimizers.extend(opts)
    stat = "max_exp_avg_sq" if amsgrad else "exp_avg_sq"

    def snapshot(i: int) -> list[torch.Tensor]:
        params = list(nets[i].parameters())
        return [p.detach().clone() for p in params] + [
            opts[i].opt.state[p][stat].clone() for p in params
        ]

    captured = []
    for i in range(4):
        for s in range(3):
            local_step(opts[i], nets[i], seed=10 * i + s)
        captured.append(snapshot(i))
    # different data, different statistics: the test would pass vacuously otherwise
    assert not torch.equal(captured[0][-1], captured[1][-1])
    for opt in opts:
        assert opt.wait_for_rounds(1, timeout=scaled(60)), opt.failed_rounds
    index = {opt.node.peer_id: i for i, opt in enumerate(opts)}
    for i, opt in enumerate(opts):
        opt.zero_grad()  # the safe point where the round's result reaches the parameters
        group = [index[p] for p in opt.last_group]
        assert i in group and len(group) >= 2
        expected = [
            sum(captured[k][j] for k in group) / len(group) for j in range(len(captured[i]))
        ]
        for actual, want in zip(snapshot(i), expected, strict=True):
            assert torch.allclose(actual, want, atol=1e-6, rtol=1e-5), (actual - want).abs().max()
    assert all(len(opt.last_group) == 4 for opt in opts)


def test_swarm_epoch_advances_every_total_steps_summed_over_peers(make_nodes) -> None:
    """Point 6: 4 peers, total_steps_in_epoch=20, stepping in turn; the swarm's epoch
    advances after 20 swarm steps (not 20 per peer), and each scheduler follows epochs."""
    nodes = make_nodes(4)
    nets = [model(i) for i in range(4)]
    opts = [
        DecentralizedSGD(
            net.parameters(),
            0.1,
            node=node,
            prefix="epochs",
            target_group_size=4,
            max_allowed_epoch_difference=1,
            total_steps_in_epoch=20,
            scheduler_cls=lambda o: torch.optim.lr_scheduler.StepLR(o, step_size=1, gamma=0.5),
            averaging_steps_period=NEVER,
            **FAST,
        )
        for net, node in zip(nets, nodes, strict=True)
    ]
    make_nodes.optimizers.extend(opts)
    for opt in opts:  # exact counts: read and publish progress on every step
        opt.tracker.refresh_interval = 0.0
    first_seen: dict[int, int] = {}
    for k in range(1, 81):
        i = (k - 1) % 4
        local_step(opts[i], nets[i], seed=k)
        # lockstep: the next peer steps only once everyone has this peer's report, so the
        # count is not blurred by gossip lag (in a free-running swarm it overshoots by that)
        assert wait_until(lambda i=i: seen_everywhere(nodes, opts[i]), scaled(15)), k
        epoch = max(opt.local_epoch for opt in opts)
        first_seen.setdefault(epoch, k)
    assert first_seen == {0: 1, 1: 20, 2: 40, 3: 60, 4: 80}
    for opt, net in zip(opts, nets, strict=True):  # the laggards catch up on their next step
        local_step(opt, net, seed=0)
    for opt in opts:
        assert opt.local_epoch == 4
        assert opt.scheduler is not None and opt.scheduler.last_epoch == opt.local_epoch
        assert opt.opt.param_groups[0]["lr"] == pytest.approx(0.1 * 0.5**4)


def test_a_peer_far_behind_loads_state_instead_of_stepping(make_nodes) -> None:
    nodes = make_nodes(2)
    nets = [model(0), model(1)]
    kwargs: dict[str, Any] = dict(
        prefix="catchup",
        target_group_size=2,
        averaging_steps_period=NEVER,
        max_allowed_epoch_difference=1,
        total_steps_in_epoch=2,
        scheduler_cls=lambda o: torch.optim.lr_scheduler.StepLR(o, step_size=1, gamma=0.9),
        timeout=scaled(20),
        **FAST,
    )
    leader = DecentralizedAdam(nets[0].parameters(), 0.05, node=nodes[0], **kwargs)
    make_nodes.optimizers.append(leader)
    leader.tracker.refresh_interval = 0.0
    for s in range(10):
        local_step(leader, nets[0], seed=s)
    assert leader.local_epoch == 5
    newcomer = DecentralizedAdam(nets[1].parameters(), 0.05, node=nodes[1], **kwargs)
    make_nodes.optimizers.append(newcomer)
    assert wait_until(lambda: seen_everywhere(nodes, leader), scaled(15))
    assert wait_until(
        lambda: nodes[1].get("catchup.all_averagers") is not None, scaled(15)
    )  # the leader offers its state
    assert local_step(newcomer, nets[1], seed=99) is None  # loaded, did not step
    assert newcomer.local_step == 0 and newcomer.local_epoch == 5
    for a, b in zip(nets[0].parameters(), nets[1].parameters(), strict=True):
        assert torch.equal(a, b)
    for a, b in zip(nets[0].parameters(), nets[1].parameters(), strict=True):
        sa, sb = leader.opt.state[a], newcomer.opt.state[b]
        assert torch.equal(sa["exp_avg_sq"], sb["exp_avg_sq"])
        assert torch.equal(sa["exp_avg"], sb["exp_avg"])
        assert float(sa["step"]) == float(sb["step"]) == 10
    assert newcomer.scheduler is not None and newcomer.scheduler.last_epoch == 5
    # and the averaged tensor is still the live optimizer state (copied in place)
    local_step(newcomer, nets[1], seed=100)
    assert newcomer.local_step == 1


def test_an_epoch_claimed_far_ahead_that_no_state_backs_is_discounted(
    make_nodes, caplog: pytest.LogCaptureFixture
) -> None:
    """A third node reports epoch 10**9 for the run and offers no state. The two honest
    peers find themselves far behind; once no donor has offered a newer state for a
    declaration period (1 s here) they name the liar and discount its claim: they never
    jump to its epoch (stepping their schedulers that many times), and their own epochs
    count again."""
    nodes = make_nodes(3)
    honest, liar = nodes[:2], nodes[2]
    nets = [model(0), model(1)]
    kwargs: dict[str, Any] = dict(
        prefix="claims",
        target_group_size=2,
        averaging_steps_period=NEVER,
        max_allowed_epoch_difference=1,
        total_steps_in_epoch=2,
        scheduler_cls=lambda o: torch.optim.lr_scheduler.StepLR(o, step_size=1, gamma=0.9),
        timeout=scaled(20),
        declare_state_period=1.0,
        **FAST,
    )
    opts = [
        DecentralizedSGD(net.parameters(), 0.1, node=n, **kwargs)
        for net, n in zip(nets, honest, strict=True)
    ]
    make_nodes.optimizers.extend(opts)
    claim = ProgressReport(liar.peer_id, 10**9, 0, 0, liar.get_time(), 1.0, False)
    until = liar.get_time() + 600
    assert liar.store(progress_key("claims"), claim.to_wire(), until, subkey=liar.peer_id)
    assert wait_until(lambda: all(gossiped(n, "claims", liar.peer_id) for n in honest), scaled(15))

    def both_stepped_and_discounted() -> bool:
        for i in (0, 1):
            local_step(opts[i], nets[i], seed=i)
        return all(liar.peer_id in opt.tracker.discounted() for opt in opts)

    with caplog.at_level("WARNING", logger="peer.optim"):
        assert wait_until(both_stepped_and_discounted, scaled(30), interval=0.2)
        for k in range(8):
            local_step(opts[k % 2], nets[k % 2], seed=k)
    assert all(opt.local_epoch < 10 for opt in opts), [opt.local_epoch for opt in opts]
    assert max(opt.local_epoch for opt in opts) >= 1  # their own epochs count again
    named = [r.getMessage() for r in caplog.records if liar.peer_id in r.getMessage()]
    assert named and "ignored" in named[0], named


def test_shutdown_stops_a_round_in_progress(make_nodes) -> None:
    """Alone, a round looks for a group until cancelled: shutdown must end it and the
    background thread, and is idempotent."""
    (node,) = make_nodes(1)
    net = model(0)
    opt = DecentralizedSGD(
        net.parameters(),
        0.1,
        node=node,
        prefix="alone",
        target_group_size=2,
        max_allowed_epoch_difference=1,
        total_steps_in_epoch=10,
        **FAST,
    )
    make_nodes.optimizers.append(opt)
    local_step(opt, net, seed=0)
    assert wait_until(lambda: opt.rounds.current is not None, scaled(10))
    opt.shutdown()
    assert not opt.rounds.thread.is_alive()
    assert opt.averaging_rounds == 0
    opt.shutdown()
    with pytest.raises(RuntimeError):
        opt.step()
    # its progress report is retracted, so the swarm stops counting it
    assert wait_until(lambda: gossiped(node, "alone", node.peer_id) is None, scaled(10))


def test_bad_arguments(make_nodes) -> None:
    (node,) = make_nodes(1)
    net = model(0)
    base: dict[str, Any] = dict(
        prefix="bad",
        target_group_size=2,
        max_allowed_epoch_difference=1,
        total_steps_in_epoch=10,
    )
    sgd = torch.optim.SGD(net.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="nothing to average"):
        DecentralizedOptimizer(sgd, node, average_parameters=False, average_gradients=False, **base)
    with pytest.raises(ValueError, match="total_steps_in_epoch"):
        DecentralizedOptimizer(
            sgd,
            node,
            average_parameters=True,
            average_gradients=False,
            **{**base, "total_steps_in_epoch": 0},
        )
    with pytest.raises(ValueError, match="not a tensor"):
        DecentralizedOptimizer(
            sgd,
            node,
            average_parameters=True,
            average_gradients=False,
            average_opt_statistics=("momentum_buffer",),
            **base,
        )
    with pytest.raises(TypeError):
        DecentralizedOptimizer(
            sgd,
            node,
            average_parameters=True,
            average_gradients=False,
            average_opt_statistics="exp_avg_sq",
            **base,
        )


def test_gradient_averaging_adds_the_group_mean_at_the_next_step(make_nodes) -> None:
    """average_gradients=True: a round averages the gradients each peer had at its last
    step; at the next step, ``.grad`` (what the optimizer uses) is the fresh local gradient
    plus that round's correction, ``mean over the group - own``, and SGD moves by it."""
    nodes = make_nodes(3)
    nets = [model(i) for i in range(3)]
    opts = [
        DecentralizedOptimizer(
            torch.optim.SGD(net.parameters(), lr=0.1),
            node,
            prefix="gradavg",
            target_group_size=3,
            average_parameters=False,
            average_gradients=True,
            averaging_steps_period=1,
            max_allowed_epoch_difference=1,
            total_steps_in_epoch=1000,
            timeout=scaled(30),
            **{**FAST, "min_matchmaking_time": 2.0},
        )
        for net, node in zip(nets, nodes, strict=True)
    ]
    make_nodes.optimizers.extend(opts)
    first = []
    for i in range(3):
        local_step(opts[i], nets[i], seed=i)  # asks for a round of these gradients
        first.append([p.grad.clone() for p in nets[i].parameters()])
    assert not torch.equal(first[0][0], first[1][0])
    for opt in opts:
        assert opt.wait_for_rounds(1, timeout=scaled(60)), opt.failed_rounds
    index = {opt.node.peer_id: i for i, opt in enumerate(opts)}
    for i, (opt, net) in enumerate(zip(opts, nets, strict=True)):
        group = [index[p] for p in opt.last_group]
        assert i in group and len(group) >= 2
        opt.zero_grad()
        g = torch.Generator().manual_seed(100 + i)
        x, y = torch.randn(8, 6, generator=g), torch.randint(0, 3, (8,), generator=g)
        torch.nn.functional.cross_entropy(net(x), y).backward()
        fresh = [p.grad.clone() for p in net.parameters()]
        before = [p.detach().clone() for p in net.parameters()]
        opt.step()
        for j, p in enumerate(net.parameters()):
            mean = sum(first[k][j] for k in group) / len(group)
            want = fresh[j] + mean - first[i][j]
            torch.testing.assert_close(p.grad, want, atol=1e-6, rtol=1e-5)
            torch.testing.assert_close(p.detach(), before[j] - 0.1 * want, atol=1e-6, rtol=1e-5)
            assert not torch.allclose(want, fresh[j], atol=1e-4), "the correction is not zero"
    assert all(len(opt.last_group) == 3 for opt in opts)
