"""What a run trains: a :class:`Task`, and the :class:`TrainingConfig` its peers share.

A run names its task (``"digits"``, ``"charlm"`` or ``"package.module:function"``, see
:mod:`peer.tasks.registry`) and carries a config dict of hyper-parameters; every peer builds
the same :class:`TrainingConfig` from them with :meth:`TrainingConfig.from_run_config` (the
run's values over :attr:`Task.defaults` over :data:`BASE_DEFAULTS`, checked). A volunteer
then trains roughly so (``peer/volunteer.py`` does it for real)::

    config = TrainingConfig.from_run_config(task, run_config)
    model = task.build_model(config)
    opt = config.make_swarm_optimizer(node, run_id, model.parameters())
    for batch in task.train_batches(config, peer_id):
        task.loss(model, batch).backward()
        opt.step(batch_size=task.batch_size(batch))
        opt.zero_grad()

This module does not import torch: naming a task and checking a run's config stay cheap.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Iterator, Mapping
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, Generic, TypedDict

from typing_extensions import TypeVar

from peer.exceptions import SwarmgradError
from peer.formats.open_types import ConfigValues
from peer.formats.run_config import (
    ALGORITHMS,
    BASE_DEFAULTS,
    FIELD_CHECKS,
    OPTIMIZERS,
    AlgorithmName,
    LRScheduleName,
    OptimizerName,
    PrecisionName,
    check_like,
    check_together,
)

if TYPE_CHECKING:
    import torch
    from torch.optim.optimizer import ParamsT

    from peer.optim.averager_options import SharedAveragerOptions
    from peer.optim.collaborative.optimizer import Optimizer
    from peer.optim.diloco.outer import DiLoCo
    from peer.optim.seam import SwarmNode

__all__ = [
    "ALGORITHMS",
    "BASE_DEFAULTS",
    "OPTIMIZERS",
    "OptimizerFactory",
    "Task",
    "TaskError",
    "TrainingConfig",
    "peer_seed",
]

OptimizerFactory = Callable[["ParamsT"], "torch.optim.Optimizer"]

# What a task's batches are (a tensor, a tuple of them, ...): each Task subclass's own. A
# subclass that does not name it (``class MyTask(Task)``) leaves it unchecked, as before.
BatchT = TypeVar("BatchT", default=Any)


class OptimizerOptions(TypedDict):
    """:meth:`TrainingConfig.optimizer_options`: keyword arguments of ``peer.Optimizer``."""

    target_batch_size: int
    batch_size_per_step: int
    optimizer: OptimizerFactory
    matchmaking_time: float
    averaging_timeout: float
    aggregator: str
    relative_weight_bound: float | None
    averager_opts: SharedAveragerOptions


class DiLoCoOptions(TypedDict):
    """:meth:`TrainingConfig.diloco_options`: keyword arguments of ``peer.DiLoCo``."""

    inner_optimizer: OptimizerFactory
    inner_steps: int
    outer_optimizer: OptimizerFactory
    fragments: int
    compression: str
    overlap: bool
    batch_size_per_step: int
    matchmaking_time: float
    averaging_timeout: float
    aggregator: str
    relative_weight_bound: float | None
    averager_opts: SharedAveragerOptions


class TaskError(SwarmgradError):
    """A task cannot be loaded: an unknown name, an import that fails, a factory that does not
    return a :class:`Task`. ``str(exc)`` is one line for a human."""


class Task(ABC, Generic[BatchT]):
    """What a run trains: the model, each peer's data, the loss and the held-out metric.

    Subclasses set the four class attributes and implement the methods; ``Task[B]`` is a
    task whose batches are of type ``B`` (``Task[torch.Tensor]``, say). Every method must
    give the same answer on every peer for the same config: the swarm averages models that
    :meth:`build_model` made alike, and compares :meth:`evaluate` figures across peers.
    Load data lazily (on the first call that needs it), not in ``__init__``: naming a task
    (``swarmgrad join`` checks it before joining) must stay cheap.
    """

    name: str  # "digits", "charlm", or "package.module:function"
    metric_name: str  # what evaluate() returns, e.g. "accuracy", "held-out loss"
    higher_is_better: bool
    # Values for TrainingConfig fields, and the task's own parameters (every other key;
    # the run's config may override them with a value of the same type).
    defaults: ConfigValues = MappingProxyType({})

    @abstractmethod
    def build_model(self, config: TrainingConfig) -> torch.nn.Module:
        """A fresh model on the CPU whose initial weights depend only on ``config.seed``."""

    @abstractmethod
    def train_batches(self, config: TrainingConfig, peer_id: str) -> Iterator[BatchT]:
        """An endless stream of training batches of ``config.batch_size`` samples (on the
        CPU), in an order fixed by ``(config.seed, peer_id)``: peers see different orders."""

    @abstractmethod
    def loss(self, model: torch.nn.Module, batch: BatchT) -> torch.Tensor:
        """The mean loss over ``batch`` (moved to the model's device here), ready for
        ``backward()``."""

    @abstractmethod
    def batch_size(self, batch: BatchT) -> int:
        """How many samples ``batch`` holds (the weight of its gradient in the swarm)."""

    @abstractmethod
    def evaluate(self, model: torch.nn.Module, config: TrainingConfig) -> float:
        """The task's metric (:attr:`metric_name`) on held-out data. Leaves the model's
        train/eval mode as it found it and builds no autograd graph."""

    def check_params(self, params: ConfigValues) -> None:
        """Raise ``ValueError`` naming the key if a task parameter is out of range. Types are
        already checked against :attr:`defaults`. The default accepts everything."""
        return None

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {getattr(self, 'name', '?')!r}>"


def peer_seed(seed: int, peer_id: str) -> int:
    """A 63-bit seed for one peer's data order, from the run's seed and the peer's id: the
    same on every call, different across peers (``torch.Generator().manual_seed(...)``)."""
    digest = hashlib.blake2b(f"{seed}/{peer_id}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") >> 1


@dataclasses.dataclass(frozen=True)
class TrainingConfig:
    """How every peer of a run trains; build it with :meth:`from_run_config`.

    Constructing it directly checks each field too (``ValueError`` naming the field), so
    ``dataclasses.replace(config, lr=0.1)`` is checked as well.
    """

    target_batch_size: int  # samples the swarm processes per optimizer step (one epoch)
    batch_size: int  # samples per local forward/backward pass
    optimizer: OptimizerName
    lr: float
    momentum: float = 0.9  # SGD's momentum; Adam and AdamW ignore it
    weight_decay: float = 0.0
    epochs: int | None = None  # the run ends at this swarm epoch; None: it never ends by itself
    checkpoint_every: int = 10  # epochs between checkpoints uploaded to the coordinator; 0: never
    seed: int = 0  # model initialisation, data split and each peer's data order
    matchmaking_time: float = 5.0  # seconds a peer waits to gather a group for a round
    averaging_timeout: float = 30.0  # seconds of silence before a round is given up
    # keys (machines) one volunteer credential, or one use of an invite, may join with; the
    # coordinator enforces it
    max_machines: int = 8
    # how reducers combine contributions: "centered_clip" (runs are open to strangers: what
    # one peer can move is bounded, and an honest group's result is its mean), "trimmed_mean",
    # or the plain "mean", which one peer can set (peer.averaging.allreduce.robust)
    aggregator: str = "centered_clip"
    # a member declaring more than this factor times its group's (lower) median weight
    # (samples) is excluded from the round; None: no bound
    relative_weight_bound: float | None = 16.0
    # peers per averaging group: each round's groups are the lines of the Moshpit grid that
    # fits the swarm (about group_size peers each; the mean in ⌈log_group_size N⌉ rounds);
    # None: every round is one group of the peers that look for one at the same time
    group_size: int | None = None
    # peer.DiLoCo instead of peer.Optimizer, and its settings (used with "diloco" only):
    # inner steps per outer round (H), the outer Nesterov SGD's lr and momentum, fragments
    # synced one after another (Streaming DiLoCo; at most inner_steps), the pseudo-gradients'
    # codec (peer.compression.compression_from_name: none, float16, bfloat16, int8, int4),
    # and whether rounds run in the background while inner steps go on
    algorithm: AlgorithmName = "collaborative"
    inner_steps: int = 100
    outer_lr: float = 0.7
    outer_momentum: float = 0.9
    fragments: int = 1
    compression: str = "none"
    overlap: bool = False
    # the model's float buffers (batch-norm running statistics) stay each volunteer's own
    # instead of being averaged with the parameters and handed to newcomers
    local_buffers: bool = False
    # batches over which the batch-norm statistics of the model a volunteer evaluates and
    # uploads are recomputed at its parameters (the same batches on every volunteer); 0: the
    # swarm's averaged statistics as they are
    recompute_statistics: int = 0
    # micro-batches of batch_size per optimizer step: a step's samples (its weight in the
    # swarm) are accumulation times batch_size, its gradient their mean
    accumulation: int = 1
    # the forward pass's dtype: "fp32" or "bf16" (torch.autocast on CPU and CUDA; parameters,
    # gradients, the optimizer's state and averaging stay float32)
    precision: PrecisionName = "fp32"
    # each step's gradient (the mean over its micro-batches) is clipped to this total norm
    # before it reaches the swarm optimizer (DiLoCo: each inner step); None: no clipping
    max_grad_norm: float | None = None
    # the learning rate at each swarm epoch (lr_at): warmup_epochs of linear warm-up, then
    # "constant", or "linear"/"cosine" decay to 0 at epochs
    lr_schedule: LRScheduleName = "constant"
    warmup_epochs: int = 0
    params: ConfigValues = dataclasses.field(default_factory=dict)  # the task's own

    def __post_init__(self) -> None:
        for name, check in FIELD_CHECKS.items():
            object.__setattr__(self, name, check(name, getattr(self, name)))
        check_together({name: getattr(self, name) for name in FIELD_CHECKS})
        if not isinstance(self.params, Mapping):
            raise ValueError(f"params: expected a mapping, got {type(self.params).__name__}")
        object.__setattr__(self, "params", MappingProxyType(dict(self.params)))

    def __reduce__(self) -> tuple[Callable[[ConfigValues], TrainingConfig], tuple[ConfigValues]]:
        # MappingProxyType does not pickle; spawned worker processes receive configs.
        return (_rebuild, (self.to_run_config(),))

    @classmethod
    def from_run_config(cls, task: Task, config: ConfigValues | None) -> TrainingConfig:
        """The run's ``config`` over ``task.defaults`` over :data:`BASE_DEFAULTS`, checked.

        A key that is neither a field nor one of the task's parameters, a value of the wrong
        type or out of range: ``ValueError`` naming the key (the organizer's mistake, told
        to every volunteer the same way)."""
        if config is None:
            config = {}
        if not isinstance(config, Mapping):
            raise ValueError(
                f"a run's config is a mapping of settings, not {type(config).__name__}"
            )
        fields = {f.name for f in dataclasses.fields(cls)} - {"params"}
        task_defaults = dict(task.defaults)
        param_defaults = {k: v for k, v in task_defaults.items() if k not in fields}
        for key in config:
            if key not in fields and key not in param_defaults:
                known = ", ".join(sorted(fields | set(param_defaults)))
                raise ValueError(f"{key}: not a setting of the task {task.name!r} (known: {known})")
        values = {**BASE_DEFAULTS, **task_defaults, **config}
        params = {
            key: check_like(key, values[key], default) for key, default in param_defaults.items()
        }
        task.check_params(params)
        return cls(**{key: values[key] for key in fields}, params=params)

    def to_run_config(self) -> ConfigValues:
        """The flat dict :meth:`from_run_config` turns back into this config (for any task
        with these parameters)."""
        values = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        values.update(values.pop("params"))
        return values

    @property
    def samples_per_step(self) -> int:
        """Samples behind one optimizer step: ``accumulation`` micro-batches of
        ``batch_size``."""
        return self.batch_size * self.accumulation

    def lr_at(self, epoch: int) -> float:
        """The learning rate of the swarm's ``epoch`` under ``lr_schedule`` and
        ``warmup_epochs`` (:func:`peer.tasks.schedule.lr_factor`); the volunteer sets it on
        the optimizer before each step, so a newcomer steps at the swarm's rate."""
        from peer.tasks.schedule import lr_factor

        factor = lr_factor(
            epoch,
            schedule=self.lr_schedule,
            warmup_epochs=self.warmup_epochs,
            epochs=self.epochs,
        )
        return self.lr * factor

    def optimizer_options(self) -> OptimizerOptions:
        """The keyword arguments of ``peer.Optimizer`` that this config sets:
        ``Optimizer(node=node, run_id=run_id, params=model.parameters(),
        **config.optimizer_options())``."""
        return {
            "target_batch_size": self.target_batch_size,
            "batch_size_per_step": self.samples_per_step,
            "optimizer": self.make_optimizer(),
            "matchmaking_time": self.matchmaking_time,
            "averaging_timeout": self.averaging_timeout,
            "aggregator": self.aggregator,
            "relative_weight_bound": self.relative_weight_bound,
            "averager_opts": self._averager_opts(),
        }

    def diloco_options(self) -> DiLoCoOptions:
        """The keyword arguments of ``peer.DiLoCo`` that this config sets:
        ``DiLoCo(node=node, run_id=run_id, params=model.parameters(),
        **config.diloco_options())``; the inner optimizer is :meth:`make_optimizer`'s."""
        return {
            "inner_optimizer": self.make_optimizer(),
            "inner_steps": self.inner_steps,
            "outer_optimizer": self.make_outer_optimizer(),
            "fragments": self.fragments,
            "compression": self.compression,
            "overlap": self.overlap,
            "batch_size_per_step": self.samples_per_step,
            "matchmaking_time": self.matchmaking_time,
            "averaging_timeout": self.averaging_timeout,
            "aggregator": self.aggregator,
            "relative_weight_bound": self.relative_weight_bound,
            "averager_opts": self._averager_opts(),
        }

    def _averager_opts(self) -> SharedAveragerOptions:
        return {} if self.group_size is None else {"target_group_size": self.group_size}

    def make_outer_optimizer(self) -> OptimizerFactory:
        """DiLoCo's outer optimizer: SGD at ``outer_lr`` with Nesterov momentum
        ``outer_momentum`` (plain SGD at momentum 0), as a picklable factory."""
        import torch

        return functools.partial(
            torch.optim.SGD,
            lr=self.outer_lr,
            momentum=self.outer_momentum,
            nesterov=self.outer_momentum > 0,
        )

    def make_swarm_optimizer(
        self,
        node: SwarmNode,
        run_id: str,
        params: Iterable[torch.Tensor],
        buffers: Iterable[torch.Tensor] | None = None,
        **extra: Any,  # more of the optimizer's keyword arguments, whichever it is
    ) -> Optimizer | DiLoCo:
        """The run's swarm optimizer over ``params``: a ``peer.Optimizer`` or, with
        ``algorithm: diloco``, a ``peer.DiLoCo``, configured by this config; ``extra``
        keyword arguments go to it as well (``client_mode``, say; ``averager_opts`` are
        merged over the config's).

        ``buffers`` are the model's buffers to share (``peer.optim.model_buffers(model)``):
        averaged as values with the parameters and handed to newcomers with the state,
        unless ``local_buffers`` keeps them each peer's own."""
        shared = None if self.local_buffers else buffers
        more: SharedAveragerOptions = extra.pop("averager_opts", {})
        if self.algorithm == "diloco":
            from peer.optim.diloco.outer import DiLoCo

            diloco = self.diloco_options()
            diloco["averager_opts"].update(more)
            return DiLoCo(
                node=node, run_id=run_id, params=params, buffers=shared, **diloco, **extra
            )
        from peer.optim.collaborative.optimizer import Optimizer

        options = self.optimizer_options()
        options["averager_opts"].update(more)
        return Optimizer(
            node=node, run_id=run_id, params=params, buffers=shared, **options, **extra
        )

    def make_optimizer(self) -> OptimizerFactory:
        """A factory for ``peer.Optimizer(optimizer=...)``: params → a torch optimizer (a
        picklable ``functools.partial``)."""
        import torch

        if self.optimizer == "sgd":
            return functools.partial(
                torch.optim.SGD, lr=self.lr, momentum=self.momentum, weight_decay=self.weight_decay
            )
        cls = torch.optim.Adam if self.optimizer == "adam" else torch.optim.AdamW
        return functools.partial(cls, lr=self.lr, weight_decay=self.weight_decay)


def _rebuild(values: ConfigValues) -> TrainingConfig:
    fields = {f.name for f in dataclasses.fields(TrainingConfig)}
    params = {k: v for k, v in values.items() if k not in fields}
    return TrainingConfig(**{k: v for k, v in values.items() if k in fields}, params=params)
