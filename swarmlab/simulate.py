"""A swarm's training, computed in one process: what the collaborative optimizer does when
every round averages every peer exactly.

Each epoch, the peers' batch streams (:meth:`Task.train_batches` with peer ids
``"peer-0"``, ``"peer-1"``, ...) take turns giving one batch until together they hold
``target_batch_size`` samples; one optimizer step on the sample-weighted mean gradient
follows (``peer.Optimizer`` computes the same thing, spread over processes), at the run's
learning-rate schedule, precision and clipping (clipped here as one step: a swarm clips each
peer's share). With ``peers=1`` it is plain single-process training with the task's config —
the reference ``bench/train.py`` compares a swarm with. Used to tune a task's defaults
quickly.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from peer.tasks.base import Task, TrainingConfig
from peer.trainer import compute_gradients, set_lr

__all__ = ["CurvePoint", "SimulationResult", "simulate_swarm"]


@dataclass(frozen=True)
class CurvePoint:
    epoch: int  # optimizer steps taken
    samples: int  # training samples processed so far
    metric: float  # the task's held-out metric at that point


@dataclass
class SimulationResult:
    model: torch.nn.Module
    samples: int  # training samples processed
    seconds: float  # wall time of training, evaluations excluded
    curve: list[CurvePoint] = field(default_factory=list)  # epoch 0 first, when evaluated


def simulate_swarm(
    task: Task,
    config: TrainingConfig,
    *,
    epochs: int,
    peers: int = 1,
    evaluate_every: int = 0,
) -> SimulationResult:
    """Train ``task``'s model for ``epochs`` swarm epochs of ``peers`` simulated peers.

    ``evaluate_every`` > 0: the curve holds the metric before training and after every
    ``evaluate_every``-th epoch (and after the last)."""
    if epochs < 0 or peers < 1 or evaluate_every < 0:
        raise ValueError("epochs and evaluate_every must not be negative; peers must be >= 1")
    model = task.build_model(config)
    model.train()
    optimizer = config.make_optimizer()(model.parameters())
    streams = [task.train_batches(config, f"peer-{i}") for i in range(peers)]
    result = SimulationResult(model, 0, 0.0)

    def evaluate(epoch: int) -> None:
        result.curve.append(CurvePoint(epoch, result.samples, task.evaluate(model, config)))

    if evaluate_every:
        evaluate(0)
    turn = 0
    for epoch in range(1, epochs + 1):
        started = time.perf_counter()
        batches, samples = [], 0
        while samples < config.target_batch_size:
            batch = next(streams[turn % peers])
            turn += 1
            batches.append(batch)
            samples += task.batch_size(batch)
        optimizer.zero_grad()
        # the mean loss over all the samples, under the run's precision, clipped, at the
        # schedule's rate: a volunteer's step (peer.trainer) on the whole epoch's batches
        set_lr(optimizer, config.lr_at(epoch - 1))
        compute_gradients(task, model, batches, config)
        optimizer.step()
        result.samples += samples
        result.seconds += time.perf_counter() - started
        if evaluate_every and (epoch % evaluate_every == 0 or epoch == epochs):
            evaluate(epoch)
    return result
