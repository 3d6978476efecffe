"""A torch learning-rate scheduler with the collaborative ``Optimizer``, as docs/porting.md
promises: it is not a ``torch.optim.Optimizer`` subclass, so the scheduler goes to its
``scheduler=`` argument (built on the wrapped optimizer) and steps once per swarm epoch —
also when a peer catches up with the swarm — and ``state_dict``/``load_state_dict`` carry
it. Peers in one process over loopback WebSockets."""

from __future__ import annotations

import warnings
from functools import partial

import pytest
import torch

from peer import Node
from peer.optim.collaborative.optimizer import Optimizer
from peer.optim.shared.progress import progress_key
from swarmlab.node_process import wait_until
from tests.conftest import scaled

LR, GAMMA = 0.1, 0.5
StepLR = partial(torch.optim.lr_scheduler.StepLR, step_size=1, gamma=GAMMA)


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))


def _optimizer(node: Node, model: torch.nn.Module, run_id: str, **kwargs: object) -> Optimizer:
    return Optimizer(
        node=node,
        run_id=run_id,
        target_batch_size=4,
        batch_size_per_step=4,
        optimizer=partial(torch.optim.SGD, lr=LR),
        params=model.parameters(),
        scheduler=StepLR,
        matchmaking_time=1.0,
        averaging_timeout=scaled(3),
        **kwargs,  # type: ignore[arg-type]
    )


def _train_one_epoch(opt: Optimizer, model: torch.nn.Module, epoch: int) -> None:
    g = torch.Generator().manual_seed(epoch)
    x = torch.randn(4, 4, generator=g)
    torch.nn.functional.mse_loss(model(x), x.sum(dim=1, keepdim=True)).backward()
    opt.step()
    opt.zero_grad()


def _sees_epoch(node: Node, peer_id: str, epoch: int) -> bool:
    record = node.get(progress_key("sched-join"))
    return (
        record is not None
        and isinstance(record.value, dict)
        and peer_id in record.value
        and record.value[peer_id].value[0] == epoch
    )


def test_step_lr_steps_once_per_swarm_epoch_and_is_saved_with_the_state() -> None:
    with Node(gossip_period=0.2) as node:
        model = _model()
        opt = _optimizer(node, model, "sched-alone")
        try:
            assert isinstance(opt.scheduler, torch.optim.lr_scheduler.StepLR)
            assert opt.scheduler.optimizer is opt.opt  # built on the wrapped optimizer
            for epoch in range(3):
                _train_one_epoch(opt, model, epoch)
                assert opt.local_epoch == epoch + 1
                # param_groups are the wrapped optimizer's: what the scheduler sets
                assert opt.param_groups[0]["lr"] == pytest.approx(LR * GAMMA ** (epoch + 1))
            saved = opt.state_dict()
            assert saved["scheduler"]["last_epoch"] == 3
        finally:
            opt.shutdown()
        restored_model = _model()
        restored = _optimizer(node, restored_model, "sched-restored")
        try:
            assert restored.param_groups[0]["lr"] == pytest.approx(LR)
            restored.load_state_dict(saved)
            assert restored.local_epoch == 3
            assert restored.scheduler.last_epoch == 3
            assert restored.param_groups[0]["lr"] == pytest.approx(LR * GAMMA**3)
        finally:
            restored.shutdown()


def test_a_scheduler_built_on_the_collaborative_optimizer_itself_is_refused_by_torch() -> None:
    """What the docs say does not work: the collaborative Optimizer is no torch optimizer."""
    with Node(gossip_period=0.2) as node:
        opt = _optimizer(node, _model(), "sched-refused")
        try:
            assert not isinstance(opt, torch.optim.Optimizer)
            with pytest.raises(TypeError, match="is not an Optimizer"):
                torch.optim.lr_scheduler.StepLR(opt, step_size=1)  # type: ignore[arg-type]
        finally:
            opt.shutdown()


def test_a_peer_catching_up_steps_its_scheduler_to_the_swarms_epoch(nodes: list[Node]) -> None:
    """A peer at epoch 4 (restored from a checkpoint); a newcomer downloads its state and
    steps its scheduler four times, before any optimizer step of its own (torch's warning
    about that order is not raised: it is intended here): both learning rates are the
    same."""
    models = [_model(), _model()]
    ahead = _optimizer(nodes[0], models[0], "sched-join", load_state_timeout=scaled(30))
    opts = [ahead]
    try:
        with warnings.catch_warnings():  # (no optimizer step first: that is the point here)
            warnings.filterwarnings("ignore", message=r"Detected call of `lr_scheduler\.step")
            for _ in range(4):
                ahead.scheduler.step()
        ahead.load_state_dict({**ahead.state_dict(), "local_epoch": 4})
        assert ahead.param_groups[0]["lr"] == pytest.approx(LR * GAMMA**4)
        assert wait_until(lambda: _sees_epoch(nodes[1], ahead.node.peer_id, 4), scaled(15))
        newcomer = _optimizer(nodes[1], models[1], "sched-join", load_state_timeout=scaled(30))
        opts.append(newcomer)
        assert newcomer.local_epoch == 4
        assert newcomer.scheduler.last_epoch == 4
        assert newcomer.param_groups[0]["lr"] == pytest.approx(LR * GAMMA**4)
    finally:
        for opt in opts:
            opt.shutdown()
