"""The built-in task: scikit-learn's bundled digits (8x8 images, 10 classes), a small MLP.

Needs no download (``sklearn.datasets.load_digits``), and everything is deterministic given
a seed: the split, the initial weights, each peer's shard and batch order.
:class:`DigitsTask` is what a run with ``--task digits`` trains. Two benchmark trainers
share one recipe (:class:`DigitsConfig`) and the same sample budget, so their accuracies
compare: :func:`train_single` (one process, the whole training set) and :func:`train_peer`
(one peer of a swarm on its shard, with :class:`~peer.optim.DecentralizedSGD`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from types import MappingProxyType
from typing import TYPE_CHECKING, Unpack

import numpy as np
import torch

from peer.formats.open_types import ConfigValues
from peer.optim.seam import SwarmNode
from peer.tasks.base import Task, TrainingConfig, peer_seed

if TYPE_CHECKING:
    from peer.optim.decentralized.optimizers import SGDWrapperOptions

    class PeerOptions(SGDWrapperOptions, total=False):
        """:func:`train_peer`'s keyword arguments of ``DecentralizedSGD``."""

        target_group_size: int | None
        dampening: float
        weight_decay: float
        nesterov: bool
        average_parameters: bool
        average_gradients: bool


__all__ = [
    "DigitsConfig",
    "DigitsData",
    "DigitsTask",
    "TrainResult",
    "accuracy",
    "batches",
    "endless_batches",
    "load_digits_split",
    "make_model",
    "shard_indices",
    "train_peer",
    "train_single",
]

NUM_FEATURES = 64  # 8x8 pixels, values 0..16
NUM_CLASSES = 10


@dataclass(frozen=True)
class DigitsData:
    """Train/test tensors: ``x_*`` [n, 64] float32 in [0, 1], ``y_*`` [n] int64."""

    x_train: torch.Tensor
    y_train: torch.Tensor
    x_test: torch.Tensor
    y_test: torch.Tensor


@dataclass(frozen=True)
class DigitsConfig:
    """One training recipe, shared by the single process and every peer."""

    epochs: int = 30
    batch_size: int = 16
    lr: float = 0.05
    momentum: float = 0.9
    hidden: int = 64
    seed: int = 0
    test_fraction: float = 0.2

    def __post_init__(self) -> None:
        if self.epochs < 1 or self.batch_size < 1 or self.hidden < 1:
            raise ValueError("epochs, batch_size and hidden must be positive")
        if not 0.0 < self.test_fraction < 1.0:
            raise ValueError("test_fraction must be in (0, 1)")


@dataclass(frozen=True)
class TrainResult:
    accuracy: float  # on the test set, in [0, 1]
    samples: int  # training samples processed
    seconds: float  # wall time of the training loop (not of set-up or evaluation)
    steps: int
    averaging_rounds: int = 0
    epoch: int = 0  # the swarm epoch this peer ended at (0 for a single process)
    bytes_sent: int = 0  # by this peer's node while it trained (0 for a single process)


def load_digits_split(seed: int = 0, test_fraction: float = 0.2) -> DigitsData:
    """The digits dataset, shuffled with ``seed`` and split into train and test sets."""
    from sklearn.datasets import load_digits  # imported here: scikit-learn is slow to import

    x, y = load_digits(return_X_y=True)
    order = np.random.default_rng(seed).permutation(len(y))
    x = torch.tensor(x[order] / 16.0, dtype=torch.float32)
    y = torch.tensor(y[order], dtype=torch.int64)
    n_test = round(len(y) * test_fraction)
    return DigitsData(x[n_test:], y[n_test:], x[:n_test], y[:n_test])


def make_model(seed: int = 0, hidden: int = 64) -> torch.nn.Module:
    """An MLP 64 → hidden → 10 whose initial weights depend only on ``seed``."""
    generator_state = torch.random.get_rng_state()
    try:
        torch.manual_seed(seed)
        return torch.nn.Sequential(
            torch.nn.Linear(NUM_FEATURES, hidden),
            torch.nn.ReLU(),
            torch.nn.Linear(hidden, NUM_CLASSES),
        )
    finally:
        torch.random.set_rng_state(generator_state)


def shard_indices(n: int, num_shards: int, index: int) -> torch.Tensor:
    """Indices of shard ``index`` of ``num_shards``: every ``num_shards``-th sample, so shards
    differ in size by at most one and (the data being shuffled) have the same distribution."""
    if not 0 <= index < num_shards:
        raise ValueError("index must be in [0, num_shards)")
    return torch.arange(index, n, num_shards)


def batches(
    x: torch.Tensor, y: torch.Tensor, batch_size: int, seed: int
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """One pass over ``(x, y)`` in an order fixed by ``seed``; the last batch may be short."""
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(seed))
    for start in range(0, len(y), batch_size):
        chunk = order[start : start + batch_size]
        yield x[chunk], y[chunk]


def endless_batches(
    x: torch.Tensor, y: torch.Tensor, batch_size: int, generator: torch.Generator
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Batches of exactly ``batch_size`` samples, forever: pass after pass over ``(x, y)``,
    each pass in a new order drawn from ``generator`` (a batch may span two passes)."""
    if batch_size < 1:
        raise ValueError("batch_size must be positive")
    pending = torch.empty(0, dtype=torch.int64)
    while True:
        while len(pending) < batch_size:
            pending = torch.cat([pending, torch.randperm(len(y), generator=generator)])
        chunk, pending = pending[:batch_size], pending[batch_size:]
        yield x[chunk], y[chunk]


@torch.no_grad()
def accuracy(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    return float((model(x).argmax(dim=1) == y).float().mean())


def _loss(model: torch.nn.Module, xb: torch.Tensor, yb: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(model(xb), yb)


def train_single(config: DigitsConfig, data: DigitsData | None = None) -> TrainResult:
    """Train one process on the whole training set with plain ``torch.optim.SGD``."""
    data = data or load_digits_split(config.seed, config.test_fraction)
    model = make_model(config.seed, config.hidden)
    opt = torch.optim.SGD(model.parameters(), lr=config.lr, momentum=config.momentum)
    samples = steps = 0
    start = time.perf_counter()
    for epoch in range(config.epochs):
        for xb, yb in batches(data.x_train, data.y_train, config.batch_size, config.seed + epoch):
            opt.zero_grad()
            torch.autograd.backward(_loss(model, xb, yb))  # typed, unlike Tensor.backward
            opt.step()
            samples += len(yb)
            steps += 1
    seconds = time.perf_counter() - start
    return TrainResult(accuracy(model, data.x_test, data.y_test), samples, seconds, steps)


def train_peer(
    node: SwarmNode,
    index: int,
    num_peers: int,
    config: DigitsConfig,
    *,
    prefix: str = "digits",
    data: DigitsData | None = None,
    start_timeout: float = 60.0,
    finish_timeout: float = 60.0,
    **optimizer_kwargs: Unpack[PeerOptions],
) -> TrainResult:
    """Train peer ``index`` of ``num_peers`` on its shard with ``DecentralizedSGD``.

    Every peer starts from the same weights (the seed's). The peer waits (up to
    ``start_timeout``) until it sees every peer's progress report, so the swarm starts
    together; after its last step it keeps averaging until every peer has finished (up to
    ``finish_timeout``), then takes one more round so that the models it evaluates agree.
    ``optimizer_kwargs`` go to :class:`~peer.optim.DecentralizedSGD` (defaults: groups of
    ``num_peers``, a round after every step, ``min_matchmaking_time=0.2``).
    """
    from peer.optim.decentralized.optimizers import DecentralizedSGD

    data = data or load_digits_split(config.seed, config.test_fraction)
    shard = shard_indices(len(data.y_train), num_peers, index)
    x, y = data.x_train[shard], data.y_train[shard]
    model = make_model(config.seed, config.hidden)
    steps_per_epoch = -(-len(data.y_train) // config.batch_size)  # of the whole swarm
    kwargs: PeerOptions = {
        "target_group_size": num_peers,
        "max_allowed_epoch_difference": 1,
        "total_steps_in_epoch": steps_per_epoch,
        "averaging_steps_period": 1,
        "min_matchmaking_time": 0.2,
        "request_timeout": 1.0,
        "timeout": 30.0,
    }
    kwargs.update(optimizer_kwargs)
    opt = DecentralizedSGD(
        model.parameters(),
        config.lr,
        node=node,
        prefix=prefix,
        momentum=config.momentum,
        **kwargs,
    )
    try:
        _wait(lambda: len(opt.tracker.fetch()) >= num_peers, start_timeout)
        samples = steps = 0
        start = time.perf_counter()
        for epoch in range(config.epochs):
            for xb, yb in batches(x, y, config.batch_size, config.seed + 1000 * index + epoch):
                opt.zero_grad()
                torch.autograd.backward(_loss(model, xb, yb))  # typed, unlike Tensor.backward
                opt.step(batch_size=len(yb))
                samples += len(yb)
                steps += 1
        seconds = time.perf_counter() - start
        done_key = f"{prefix}.done"
        node.store(done_key, True, node.get_time() + 600, subkey=node.peer_id)

        def everyone_done() -> bool:
            found = node.get(done_key)
            return found is not None and len(found.value) >= num_peers

        _wait(everyone_done, finish_timeout)
        # a round that starts after everyone finished: the evaluated models agree
        rounds = opt.averaging_rounds + (1 if opt.rounds.current is not None else 0)
        opt.average_now()
        opt.wait_for_rounds(rounds + 1, timeout=finish_timeout)
        opt.zero_grad()  # the safe point where the last round reaches the parameters
        return TrainResult(
            accuracy(model, data.x_test, data.y_test),
            samples,
            seconds,
            steps,
            opt.averaging_rounds,
            opt.local_epoch,
        )
    finally:
        opt.shutdown()


def _wait(predicate: Callable[[], bool], timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.02)
    return True


class DigitsTask(Task[tuple[torch.Tensor, torch.Tensor]]):
    """Digits with the collaborative optimizer: the MLP of :func:`make_model`, test accuracy.

    Every peer sees the whole training set (peers cannot know how many others there are, so
    there are no shards), in an order drawn from ``(seed, peer_id)``. The split depends on
    the seed only, so every peer evaluates on the same test set.

    Defaults, tuned by simulating 4 peers in one process (one Adam step per 256 samples,
    ``tests/peer/tasks/test_digits_task.py``): on each of seeds 0-9 test accuracy reaches
    0.93 by epoch 20 and is 0.955 or more at epoch 40 (mean 0.965), where the run ends; four
    real peers on loopback ended at 0.978 (their epochs hold a little more than 256 samples:
    peers finish the batch in hand when the target is reached). A wider hidden layer
    (256, not the benchmark's 64) and a large step (lr 0.03) are what make 40 steps enough.
    Matchmaking waits 0.5 s: loopback and LAN swarms form their groups well within that.
    """

    name = "digits"
    metric_name = "accuracy"
    higher_is_better = True
    defaults: ConfigValues = MappingProxyType(
        {
            "target_batch_size": 256,
            "batch_size": 32,
            "optimizer": "adam",
            "lr": 0.03,
            "epochs": 40,
            "checkpoint_every": 10,
            "matchmaking_time": 0.5,
            "averaging_timeout": 15.0,
            # the task's own parameters
            "hidden": 256,
            "test_fraction": 0.2,
        }
    )

    def __init__(self) -> None:
        self._data: dict[tuple[int, float], DigitsData] = {}

    def check_params(self, params: ConfigValues) -> None:
        if params["hidden"] < 1:
            raise ValueError(f"hidden: must be at least 1, got {params['hidden']}")
        if not 0.0 < params["test_fraction"] < 1.0:
            raise ValueError(f"test_fraction: must be in (0, 1), got {params['test_fraction']}")

    def data(self, config: TrainingConfig) -> DigitsData:
        """The split for this config (loaded once per task object)."""
        key = (config.seed, float(config.params["test_fraction"]))
        if key not in self._data:
            self._data[key] = load_digits_split(*key)
        return self._data[key]

    def build_model(self, config: TrainingConfig) -> torch.nn.Module:
        return make_model(config.seed, int(config.params["hidden"]))

    def train_batches(
        self, config: TrainingConfig, peer_id: str
    ) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        data = self.data(config)
        generator = torch.Generator().manual_seed(peer_seed(config.seed, peer_id))
        return endless_batches(data.x_train, data.y_train, config.batch_size, generator)

    def loss(
        self, model: torch.nn.Module, batch: tuple[torch.Tensor, torch.Tensor]
    ) -> torch.Tensor:
        device = next(model.parameters()).device
        x, y = batch
        return _loss(model, x.to(device), y.to(device))

    def batch_size(self, batch: tuple[torch.Tensor, torch.Tensor]) -> int:
        return len(batch[1])

    def evaluate(self, model: torch.nn.Module, config: TrainingConfig) -> float:
        data = self.data(config)
        device = next(model.parameters()).device
        was_training = model.training
        model.eval()
        try:
            return accuracy(model, data.x_test.to(device), data.y_test.to(device))
        finally:
            model.train(was_training)
