"""The digits recipe (:class:`~peer.tasks.digits.DigitsConfig`) trained by a swarm peer with
each of the swarm's training methods, for side-by-side comparison (``bench/train.py``).

Each peer is a machine of one process: its own node, its shard of the training set, plain
``torch.optim.SGD`` with the recipe's learning rate and momentum, and one of
:data:`METHODS` (``collaborative``, ``delayed``, ``lightning``, ``hierarchical``, ``daso``;
:func:`train_peer_with`'s docstring says what each is). :func:`train_peer_with` returns a
:class:`~peer.tasks.digits.TrainResult` whose ``bytes_sent`` is what this peer's node sent
while it trained.
"""

from __future__ import annotations

import math
import time
from typing import Any

import torch

from peer.tasks.digits import (
    DigitsConfig,
    DigitsData,
    TrainResult,
    accuracy,
    endless_batches,
    load_digits_split,
    make_model,
    shard_indices,
)
from swarmlab.node_process import wait_until

__all__ = ["METHODS", "train_peer_with"]

METHODS = ("collaborative", "delayed", "lightning", "hierarchical", "daso")


def train_peer_with(
    node: Any,
    index: int,
    num_peers: int,
    config: DigitsConfig,
    method: str,
    *,
    prefix: str = "digits-compare",
    data: DigitsData | None = None,
    matchmaking_time: float = 0.2,
    start_timeout: float = 60.0,
) -> TrainResult:
    """Train peer ``index`` of ``num_peers`` with ``method`` (one of :data:`METHODS`).

    Each peer is a machine of one process: its own node, its shard of the training set, plain
    ``torch.optim.SGD`` with the recipe's learning rate and momentum. Every peer takes the same
    number of steps per epoch (enough to cover the largest shard), so the swarm as a whole
    processes at least the single process's samples and the peers stay in step:

    * ``collaborative`` — :class:`~peer.Optimizer` with ``target_batch_size`` of one batch per
      peer: a step of the averaged gradient whenever the swarm has processed that many samples
      (large-batch SGD; a peer keeps accumulating while a round runs);

    * ``delayed`` — the same with ``delay_grad_averaging`` and ``delay_optimizer_step`` (the
      optimizer offloaded, its state averaged in the background): the averaging and the step
      of an epoch overlap the next epoch's batches, one step stale;
    * ``lightning`` — the same optimizer as ``collaborative``, driven by a Lightning ``Trainer``
      with :class:`~peer.integrations.lightning.SwarmgradStrategy` (needs the ``lightning``
      extra);
    * ``hierarchical`` — :class:`~peer.optim.HierarchicalModelAverager` with
      ``{2: 2, 4: num_peers}``: pairs average every 2 steps, everyone every
      4; the last step is a top-level one, so the peers end with the same model;
    * ``daso`` — :class:`~peer.optim.DASO` with one warm-up and one cool-down epoch (blocking global syncs after every batch),
      the cycling phase in between; every epoch ends with a blocking sync.
    """
    if method not in METHODS:
        raise ValueError(f"method must be one of {', '.join(METHODS)}")
    from peer.optim.collaborative.optimizer import Optimizer
    from peer.optim.hierarchy.daso import DASO
    from peer.optim.hierarchy.hierarchical import HierarchicalModelAverager

    data = data or load_digits_split(config.seed, config.test_fraction)
    n = len(data.y_train)
    shard = shard_indices(n, num_peers, index)
    x, y = data.x_train[shard], data.y_train[shard]
    steps_per_epoch = math.ceil(math.ceil(n / num_peers) / config.batch_size)
    model = make_model(config.seed, config.hidden)
    opt = torch.optim.SGD(model.parameters(), lr=config.lr, momentum=config.momentum)
    stream = endless_batches(
        x, y, config.batch_size, torch.Generator().manual_seed(config.seed + 1000 * index)
    )
    ready = f"{prefix}.{method}.ready"
    node.store(ready, True, node.get_time() + 600, subkey=node.peer_id)

    def everyone_ready() -> bool:
        found = node.get(ready, latest=True)
        return found is not None and len(found.value) >= num_peers

    if not wait_until(everyone_ready, start_timeout, 0.02):
        raise RuntimeError("the other peers did not show up")
    common = dict(
        node=node,
        prefix=f"{prefix}.{method}",
        matchmaking_time=matchmaking_time,
        averaging_timeout=30.0,
    )
    sent_before = node.bytes_sent
    samples = steps = 0
    start = time.perf_counter()

    def train_batch() -> torch.Tensor:
        nonlocal samples, steps
        xb, yb = next(stream)
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(xb), yb)
        torch.autograd.backward(loss)  # typed, unlike Tensor.backward
        samples += len(yb)
        steps += 1
        return loss.detach()

    done = f"{prefix}.{method}.done"

    def stay_for_the_others(collab: Any) -> None:
        """Announce this peer is done, and take part in the others' last rounds."""
        node.store(done, True, node.get_time() + 600, subkey=node.peer_id)

        def everyone_done() -> bool:
            collab.step(batch_size=0)
            found = node.get(done, latest=True)
            return found is not None and len(found.value) >= num_peers

        wait_until(everyone_done, 120, 0.05)

    if method in ("collaborative", "delayed"):
        delayed = method == "delayed"
        collab = Optimizer(
            node=node,
            run_id=f"{prefix}.{method}",
            target_batch_size=num_peers * config.batch_size,
            optimizer=lambda params: torch.optim.SGD(
                params, lr=config.lr, momentum=config.momentum
            ),
            params=model.parameters(),
            matchmaking_time=matchmaking_time,
            averaging_timeout=30.0,
            delay_grad_averaging=delayed,
            delay_optimizer_step=delayed,
        )
        try:
            for _ in range(steps_per_epoch * config.epochs):
                train_batch()
                collab.step(batch_size=config.batch_size)
            stay_for_the_others(collab)
            collab.wait_for_pending(timeout=60)
        finally:
            collab.shutdown()
        rounds = collab.rounds_done
        epoch = collab.local_epoch
    elif method == "lightning":
        rounds, epoch = _train_lightning(
            node,
            model,
            stream,
            steps_per_epoch * config.epochs,
            config,
            target_batch_size=num_peers * config.batch_size,
            run_id=f"{prefix}.{method}",
            matchmaking_time=matchmaking_time,
            stay=stay_for_the_others,
        )
        samples = steps_per_epoch * config.epochs * config.batch_size
        steps = steps_per_epoch * config.epochs
    elif method == "hierarchical":
        top = 4
        averager = HierarchicalModelAverager({2: min(2, num_peers), top: num_peers}, **common)
        total = steps_per_epoch * config.epochs
        total += (1 - total) % top  # the last step (index total - 1) averages everyone
        try:
            for _ in range(total):
                train_batch()
                opt.step()
                averager.average_parameters(model.parameters())
        finally:
            averager.shutdown()
        rounds = sum(averager.rounds.values())
        epoch = config.epochs
    else:
        daso = DASO(
            opt,
            total_epochs=config.epochs,
            warmup_epochs=1,
            cooldown_epochs=1,
            target_group_size=num_peers,
            **common,
        )
        daso.set_model(model)
        daso.last_batch = steps_per_epoch - 1
        try:
            for _ in range(config.epochs):
                total_loss = 0.0
                for _ in range(steps_per_epoch):
                    total_loss += float(train_batch())
                    daso.step()
                daso.epoch_loss_logic(total_loss / steps_per_epoch)
        finally:
            daso.shutdown()
        rounds = daso.global_rounds_done
        epoch = daso.epoch
    seconds = time.perf_counter() - start
    return TrainResult(
        accuracy(model, data.x_test, data.y_test),
        samples,
        seconds,
        steps,
        rounds,
        epoch,
        bytes_sent=node.bytes_sent - sent_before,
    )


def _train_lightning(
    node: Any,
    model: torch.nn.Module,
    stream: Any,
    total_batches: int,
    config: DigitsConfig,
    *,
    target_batch_size: int,
    run_id: str,
    matchmaking_time: float,
    stay: Any,
) -> tuple[int, int]:
    """Train ``model`` on ``total_batches`` of ``stream`` through a Lightning ``Trainer``;
    returns the averaging rounds done and the swarm epoch reached."""
    import lightning as L

    from peer.integrations.lightning import SwarmgradStrategy

    class Batches(torch.utils.data.IterableDataset[Any]):
        def __iter__(self) -> Any:
            for _ in range(total_batches):
                yield next(stream)

    class Module(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = model

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            xb, yb = batch
            return torch.nn.functional.cross_entropy(self.net(xb), yb)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=config.lr, momentum=config.momentum)

        def train_dataloader(self) -> Any:
            return torch.utils.data.DataLoader(Batches(), batch_size=None)

        def on_train_end(self) -> None:
            stay(strategy.optimizer)

    strategy = SwarmgradStrategy(
        target_batch_size=target_batch_size,
        run_id=run_id,
        batch_size=config.batch_size,
        matchmaking_time=matchmaking_time,
        averaging_timeout=30.0,
        node=node,
    )
    trainer = L.Trainer(
        strategy=strategy,
        max_epochs=1,
        limit_val_batches=0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(Module())
    opt = strategy.optimizer
    assert opt is not None  # built at the first batch
    return opt.rounds_done, opt.local_epoch
