"""The run options of the volunteer's training loop, in a swarm: micro-batch accumulation and
bf16 autocast leave the swarm on single-process training (one batch of the step's samples),
a schedule's warm-up reaches the optimizer at the swarm's epoch, a newcomer's included, and
clipping bounds each step's gradient.

Two or three nodes in one process over loopback WebSockets, each peer in a thread of its own
stepping as :class:`peer.trainer.Trainer` does (:func:`~peer.trainer.set_lr`,
:func:`~peer.trainer.compute_gradients`, ``step``).
"""

from __future__ import annotations

import threading
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from peer import Node
from peer.optim.shared.progress import progress_key
from peer.tasks.base import TrainingConfig
from peer.trainer import Trainer, compute_gradients, set_lr
from peer.volunteer import JoinOptions, Volunteer
from tests.conftest import scaled
from tests.peer.averaging.conftest import wait_for

SAMPLES = 32  # per optimizer step, on the two peers together (16 each)
EPOCHS = 5


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))


def samples(rank: int, epoch: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Peer ``rank``'s ``size`` samples of ``epoch``."""
    g = torch.Generator().manual_seed(1000 * epoch + rank)
    x = torch.randn(size, 8, generator=g)
    return x, x.sum(dim=1, keepdim=True).sin()


@dataclass
class Task:
    """The loss of a batch ``(x, y)``; records the dtype the model's output had."""

    dtypes: set[torch.dtype] = field(default_factory=set)
    name: str = "sine"

    def loss(self, model: torch.nn.Module, batch: Any) -> torch.Tensor:
        x, y = batch
        out = model(x)
        self.dtypes.add(out.dtype)
        return torch.nn.functional.mse_loss(out.float(), y)

    def batch_size(self, batch: Any) -> int:
        return len(batch[0])

    def evaluate(self, model: torch.nn.Module, config: Any) -> float:
        with torch.no_grad():
            return float(self.loss(model, samples(99, 0, 64)))


def config(batch_size: int, accumulation: int, **options: Any) -> TrainingConfig:
    return TrainingConfig(
        target_batch_size=SAMPLES,
        batch_size=batch_size,
        accumulation=accumulation,
        optimizer="sgd",
        lr=0.1,
        momentum=0.9,
        epochs=EPOCHS,
        lr_schedule="linear",
        warmup_epochs=2,
        # the group forms as soon as both are in (group_size=2); a long wait only
        # keeps a loaded machine from failing a round, after which a peer steps alone
        matchmaking_time=scaled(10.0),
        aggregator="mean",
        group_size=2,
        **options,
    )


@pytest.fixture
def run_id() -> str:
    # a run of its own per test
    return f"trainer-options-{uuid.uuid4().hex[:8]}"


@pytest.fixture
def two_nodes() -> Iterator[list[Node]]:
    a = Node(gossip_period=0.2)
    b = Node(a.visible_addresses, gossip_period=0.2)
    assert wait_for(lambda: len(a.members()) == len(b.members()) == 2, 15)
    yield [a, b]
    b.shutdown()
    a.shutdown()


def train_peer(
    run_id: str, rank: int, node: Node, cfg: TrainingConfig, task: Task, model: torch.nn.Module
) -> list[torch.Tensor]:
    """Peer ``rank``: each epoch its 16 samples as ``cfg.accumulation`` micro-batches, one
    step, then steps without samples until the swarm's epoch moves; its final parameters."""
    opt = cfg.make_swarm_optimizer(node, run_id, model.parameters())
    try:
        while opt.local_epoch < EPOCHS:
            epoch = opt.local_epoch
            x, y = samples(rank, epoch, cfg.samples_per_step)
            parts = zip(x.split(cfg.batch_size), y.split(cfg.batch_size), strict=True)
            set_lr(opt, cfg.lr_at(epoch))
            _, n = compute_gradients(task, model, list(parts), cfg)
            opt.step(batch_size=n)
            opt.zero_grad()

            def moved(opt: Any = opt, epoch: int = epoch) -> bool:
                opt.step(batch_size=0)
                return bool(opt.local_epoch != epoch)

            assert wait_for(moved, 60), f"peer {rank} stuck at epoch {epoch}"
        assert opt.rounds_failed == 0, f"peer {rank}: a round failed ({opt.last_failure})"
        return [p.detach().clone() for p in model.parameters()]
    finally:
        opt.shutdown()


def train_swarm(
    run_id: str, nodes: list[Node], configs: list[TrainingConfig], task: Task
) -> list[Any]:
    results: list[Any] = [None] * len(configs)
    # built here, one after the other: make_model seeds torch's global generator
    models = [make_model() for _ in configs]

    def run(rank: int) -> None:
        try:
            results[rank] = train_peer(run_id, rank, nodes[rank], configs[rank], task, models[rank])
        except BaseException as exc:  # the test reads it
            results[rank] = exc

    threads = [threading.Thread(target=run, args=(r,)) for r in range(len(configs))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(scaled(300))
    for result in results:
        if isinstance(result, BaseException):
            raise result
    return results


def single_process(cfg: TrainingConfig) -> list[torch.Tensor]:
    """One process, one step per epoch on both peers' samples as one batch, at the
    schedule's learning rate, in float32."""
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=cfg.lr, momentum=cfg.momentum)
    for epoch in range(EPOCHS):
        xs, ys = zip(*(samples(rank, epoch, SAMPLES // 2) for rank in range(2)), strict=True)
        for group in opt.param_groups:
            group["lr"] = cfg.lr_at(epoch)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(torch.cat(xs)), torch.cat(ys)).backward()
        opt.step()
    return [p.detach() for p in model.parameters()]


def test_accumulation_of_micro_batches_gives_single_process_training(
    two_nodes: list[Node], run_id: str
) -> None:
    """One peer steps on 16 samples at once, the other on four micro-batches of 4: both end
    on the parameters of one process stepping on the 32 samples (the schedule's rates too)."""
    task = Task()
    results = train_swarm(run_id, two_nodes, [config(16, 1), config(4, 4)], task)
    reference = single_process(config(16, 1))
    for result in results:
        for mine, expected in zip(result, reference, strict=True):
            torch.testing.assert_close(mine, expected, atol=1e-5, rtol=0)
    assert task.dtypes == {torch.float32}


def test_bf16_autocast_keeps_the_peers_equal_with_float32_parameters(
    two_nodes: list[Node], run_id: str
) -> None:
    task = Task()
    configs = [config(16, 1, precision="bf16"), config(4, 4, precision="bf16")]
    first, second = train_swarm(run_id, two_nodes, configs, task)
    assert task.dtypes == {torch.bfloat16}, "the forward pass ran under autocast"
    for mine, theirs in zip(first, second, strict=True):
        assert mine.dtype == torch.float32
        torch.testing.assert_close(mine, theirs, atol=1e-6, rtol=0)
    # near float32 training, but not it: bf16's rounding shows
    reference = single_process(config(16, 1))
    gaps = [
        float((mine - expected).abs().max())
        for mine, expected in zip(first, reference, strict=True)
    ]
    assert 0 < max(gaps) < 0.01, gaps


def test_a_newcomer_steps_at_the_swarms_scheduled_learning_rate(
    two_nodes: list[Node], run_id: str, tmp_path: Path
) -> None:
    """The swarm is at epoch 6 of a warm-up of 10: a newcomer's first step (the trainer's
    own) sets the rate of epoch 6, not of its own first step."""
    a, b = two_nodes
    cfg = TrainingConfig(
        target_batch_size=10_000,
        batch_size=4,
        optimizer="sgd",
        lr=0.1,
        warmup_epochs=10,
        checkpoint_every=0,
        matchmaking_time=scaled(1.0),
        aggregator="mean",
    )
    ahead_model = make_model()
    ahead = cfg.make_swarm_optimizer(a, run_id, ahead_model.parameters(), load_state_timeout=5.0)
    newcomer = None
    try:
        ahead.load_state_dict({**ahead.state_dict(), "local_epoch": 6})
        assert ahead.state_averager.state_sharing_priority == 6.0
        ahead.step(batch_size=0)  # its progress report of epoch 6

        def sees_epoch_6() -> bool:
            record = b.get(progress_key(run_id))
            return (
                record is not None
                and a.peer_id in record.value
                and record.value[a.peer_id].value[0] == 6
            )

        assert wait_for(sees_epoch_6, 15)
        model = make_model()
        newcomer = cfg.make_swarm_optimizer(
            b, run_id, model.parameters(), load_state_timeout=scaled(30)
        )
        assert newcomer.local_epoch == 6
        volunteer = Volunteer(JoinOptions("http://c", "sgj_x", data_dir=tmp_path))
        session = SimpleNamespace(submit_report=lambda fields: None, coordinator_reachable=True)
        answer = SimpleNamespace(peer_id=b.peer_id, report_interval_s=10.0)
        task = Task()
        trainer = Trainer(volunteer, None, answer, session, task, cfg, model, newcomer)
        try:
            trainer._step([samples(1, 0, 4)])
        finally:
            trainer.close()
        assert trainer.samples == 4
        assert [g["lr"] for g in newcomer.param_groups] == [pytest.approx(0.1 * 7 / 11)]
        assert cfg.lr_at(6) != cfg.lr_at(0)
    finally:
        if newcomer is not None:
            newcomer.shutdown()
        ahead.shutdown()


def test_clipping_bounds_each_steps_gradient() -> None:
    task = Task()
    model = make_model()
    x, y = samples(0, 0, 16)
    batches = [(x, y * 100), (x, y * 100)]  # a steep loss: a large gradient
    loose = config(8, 2)
    compute_gradients(task, model, batches, loose)
    norm = torch.nn.utils.get_total_norm([p.grad for p in model.parameters()])
    assert norm > 10
    model.zero_grad()
    compute_gradients(task, model, batches, config(8, 2, max_grad_norm=1.0))
    clipped = torch.nn.utils.get_total_norm([p.grad for p in model.parameters()])
    assert float(clipped) == pytest.approx(1.0, rel=1e-5)


def test_with_diloco_the_schedule_sets_the_inner_optimizers_rate(run_id: str) -> None:
    cfg = TrainingConfig(
        target_batch_size=64,
        batch_size=4,
        optimizer="adamw",
        lr=0.01,
        algorithm="diloco",
        inner_steps=4,
        warmup_epochs=3,
    )
    model = make_model()
    node = Node(gossip_period=0.2)
    opt = cfg.make_swarm_optimizer(node, run_id, model.parameters())
    try:
        set_lr(opt, cfg.lr_at(1))
        assert [g["lr"] for g in opt.inner_optimizer.param_groups] == [pytest.approx(0.005)]
    finally:
        opt.shutdown()
        node.shutdown()
