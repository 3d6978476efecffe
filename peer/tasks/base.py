"""What a run trains: a :class:`Task`, and the :class:`TrainingConfig` its peers share.

A run names its task (``"digits"``, ``"charlm"`` or ``"package.module:function"``, see
:mod:`peer.tasks.registry`) and carries a config dict of hyper-parameters. Every peer builds
the same :class:`TrainingConfig` from them with :meth:`TrainingConfig.from_run_config`: the
run's values over the task's :attr:`Task.defaults` over :data:`BASE_DEFAULTS`, checked.

A volunteer then trains roughly like this (``peer/volunteer.py`` does it for real)::

    config = TrainingConfig.from_run_config(task, run_config)
    model = task.build_model(config)
    opt = peer.Optimizer(node=node, run_id=run_id, params=model.parameters(),
                         **config.optimizer_options())
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
import math
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Iterator, Mapping
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, Literal, get_args

from peer.exceptions import SwarmgradError

if TYPE_CHECKING:
    import torch

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

OptimizerName = Literal["sgd", "adam", "adamw"]
OPTIMIZERS: tuple[str, ...] = get_args(OptimizerName)
# how peers combine their work: "collaborative" (peer.Optimizer: a global batch, averaged
# gradients every epoch) or "diloco" (peer.DiLoCo: inner_steps local steps, then an outer
# step on the averaged pseudo-gradient; the choice for home links)
AlgorithmName = Literal["collaborative", "diloco"]
ALGORITHMS: tuple[str, ...] = get_args(AlgorithmName)
OptimizerFactory = Callable[[Iterable[Any]], "torch.optim.Optimizer"]


class TaskError(SwarmgradError):
    """A task cannot be loaded: an unknown name, an import that fails, a factory that does not
    return a :class:`Task`. ``str(exc)`` is one line for a human."""


class Task(ABC):
    """What a run trains: the model, each peer's data, the loss and the held-out metric.

    Subclasses set the four class attributes and implement the methods. Every method must
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
    defaults: Mapping[str, Any] = MappingProxyType({})

    @abstractmethod
    def build_model(self, config: TrainingConfig) -> torch.nn.Module:
        """A fresh model on the CPU whose initial weights depend only on ``config.seed``."""

    @abstractmethod
    def train_batches(self, config: TrainingConfig, peer_id: str) -> Iterator[Any]:
        """An endless stream of training batches of ``config.batch_size`` samples (on the
        CPU), in an order fixed by ``(config.seed, peer_id)``: peers see different orders."""

    @abstractmethod
    def loss(self, model: torch.nn.Module, batch: Any) -> torch.Tensor:
        """The mean loss over ``batch`` (moved to the model's device here), ready for
        ``backward()``."""

    @abstractmethod
    def batch_size(self, batch: Any) -> int:
        """How many samples ``batch`` holds (the weight of its gradient in the swarm)."""

    @abstractmethod
    def evaluate(self, model: torch.nn.Module, config: TrainingConfig) -> float:
        """The task's metric (:attr:`metric_name`) on held-out data. Leaves the model's
        train/eval mode as it found it and builds no autograd graph."""

    def check_params(self, params: Mapping[str, Any]) -> None:
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


# The values a TrainingConfig field takes when neither the run nor the task sets it.
BASE_DEFAULTS: Mapping[str, Any] = MappingProxyType(
    {
        "target_batch_size": 256,
        "batch_size": 32,
        "optimizer": "adam",
        "lr": 1e-3,
        "momentum": 0.9,
        "weight_decay": 0.0,
        "epochs": None,
        "checkpoint_every": 10,
        "seed": 0,
        "matchmaking_time": 5.0,
        "averaging_timeout": 30.0,
        "max_machines": 8,
        "aggregator": "centered_clip",
        "relative_weight_bound": 16.0,
        "algorithm": "collaborative",
        "inner_steps": 100,
        "outer_lr": 0.7,
        "outer_momentum": 0.9,
        "fragments": 1,
        "compression": "none",
        "overlap": False,
    }
)


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
    # or the plain "mean", which one peer can set (peer.averaging.robust)
    aggregator: str = "centered_clip"
    # a member declaring more than this factor times its group's (lower) median weight
    # (samples) is excluded from the round; None: no bound
    relative_weight_bound: float | None = 16.0
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
    params: Mapping[str, Any] = dataclasses.field(default_factory=dict)  # the task's own

    def __post_init__(self) -> None:
        for name, check in _FIELD_CHECKS.items():
            object.__setattr__(self, name, check(name, getattr(self, name)))
        if self.fragments > self.inner_steps:
            raise ValueError(
                f"fragments: at most inner_steps ({self.inner_steps}), each fragment syncs "
                f"after an inner step of its own; got {self.fragments}"
            )
        if not isinstance(self.params, Mapping):
            raise ValueError(f"params: expected a mapping, got {_kind(self.params)}")
        object.__setattr__(self, "params", MappingProxyType(dict(self.params)))

    def __reduce__(self) -> tuple[Any, ...]:
        # MappingProxyType does not pickle; spawned worker processes receive configs.
        return (_rebuild, (self.to_run_config(),))

    @classmethod
    def from_run_config(cls, task: Task, config: Mapping[str, Any] | None) -> TrainingConfig:
        """The run's ``config`` over ``task.defaults`` over :data:`BASE_DEFAULTS`, checked.

        A key that is neither a field nor one of the task's parameters, a value of the wrong
        type or out of range: ``ValueError`` naming the key (the organizer's mistake, told
        to every volunteer the same way)."""
        if config is None:
            config = {}
        if not isinstance(config, Mapping):
            raise ValueError(f"a run's config is a mapping of settings, not {_kind(config)}")
        fields = {f.name for f in dataclasses.fields(cls)} - {"params"}
        task_defaults = dict(task.defaults)
        param_defaults = {k: v for k, v in task_defaults.items() if k not in fields}
        for key in config:
            if key not in fields and key not in param_defaults:
                known = ", ".join(sorted(fields | set(param_defaults)))
                raise ValueError(f"{key}: not a setting of the task {task.name!r} (known: {known})")
        values = {**BASE_DEFAULTS, **task_defaults, **config}
        params = {
            key: _check_like(key, values[key], default) for key, default in param_defaults.items()
        }
        task.check_params(params)
        return cls(**{key: values[key] for key in fields}, params=params)

    def to_run_config(self) -> dict[str, Any]:
        """The flat dict :meth:`from_run_config` turns back into this config (for any task
        with these parameters)."""
        values = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        values.update(values.pop("params"))
        return values

    def optimizer_options(self) -> dict[str, Any]:
        """The keyword arguments of ``peer.Optimizer`` that this config sets:
        ``Optimizer(node=node, run_id=run_id, params=model.parameters(),
        **config.optimizer_options())``."""
        return {
            "target_batch_size": self.target_batch_size,
            "batch_size_per_step": self.batch_size,
            "optimizer": self.make_optimizer(),
            "matchmaking_time": self.matchmaking_time,
            "averaging_timeout": self.averaging_timeout,
            "aggregator": self.aggregator,
            "relative_weight_bound": self.relative_weight_bound,
        }

    def diloco_options(self) -> dict[str, Any]:
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
            "batch_size_per_step": self.batch_size,
            "matchmaking_time": self.matchmaking_time,
            "averaging_timeout": self.averaging_timeout,
            "aggregator": self.aggregator,
            "relative_weight_bound": self.relative_weight_bound,
        }

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
        self, node: SwarmNode, run_id: str, params: Iterable[Any], **extra: Any
    ) -> Any:
        """The run's swarm optimizer over ``params``: a ``peer.Optimizer`` or, with
        ``algorithm: diloco``, a ``peer.DiLoCo``, configured by this config; ``extra``
        keyword arguments go to it as well (``client_mode``, say)."""
        if self.algorithm == "diloco":
            from peer.optim.diloco import DiLoCo

            return DiLoCo(node=node, run_id=run_id, params=params, **self.diloco_options(), **extra)
        from peer.optim.collaborative import Optimizer

        return Optimizer(
            node=node, run_id=run_id, params=params, **self.optimizer_options(), **extra
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


def _rebuild(values: dict[str, Any]) -> TrainingConfig:
    fields = {f.name for f in dataclasses.fields(TrainingConfig)}
    params = {k: v for k, v in values.items() if k not in fields}
    return TrainingConfig(**{k: v for k, v in values.items() if k in fields}, params=params)


# --------------------------------------------------------------------------- value checks


def _kind(value: Any) -> str:
    return "null" if value is None else type(value).__name__


def _integer(
    key: str, value: Any, *, minimum: int | None = None, maximum: int | None = None
) -> int:
    # JSON has one number type: 1000.0 or 1e3 is taken as 1000, 0.5 is refused.
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if not isinstance(value, int) or isinstance(value, bool):
        raise ValueError(f"{key}: expected an integer, got {_kind(value)} {value!r}")
    if minimum is not None and value < minimum:
        raise ValueError(f"{key}: must be at least {minimum}, got {value}")
    if maximum is not None and value > maximum:
        raise ValueError(f"{key}: must be at most {maximum}, got {value}")
    return value


def _number(key: str, value: Any) -> float:
    if not isinstance(value, int | float) or isinstance(value, bool):
        raise ValueError(f"{key}: expected a number, got {_kind(value)} {value!r}")
    if not math.isfinite(value):
        raise ValueError(f"{key}: must be finite, got {value}")
    return float(value)


def _positive(key: str, value: Any) -> float:
    number = _number(key, value)
    if number <= 0:
        raise ValueError(f"{key}: must be positive, got {value}")
    return number


def _fraction(key: str, value: Any) -> float:
    number = _number(key, value)
    if not 0.0 <= number < 1.0:
        raise ValueError(f"{key}: must be in [0, 1), got {value}")
    return number


def _non_negative(key: str, value: Any) -> float:
    number = _number(key, value)
    if number < 0:
        raise ValueError(f"{key}: must not be negative, got {value}")
    return number


def _optimizer(key: str, value: Any) -> str:
    if value not in OPTIMIZERS or not isinstance(value, str):
        raise ValueError(f"{key}: expected one of {', '.join(OPTIMIZERS)}, got {value!r}")
    return value


def _algorithm(key: str, value: Any) -> str:
    if value not in ALGORITHMS or not isinstance(value, str):
        raise ValueError(f"{key}: expected one of {', '.join(ALGORITHMS)}, got {value!r}")
    return value


def _compression(key: str, value: Any) -> str:
    from peer.compression import compression_from_name

    try:
        compression_from_name(value)
    except ValueError as exc:
        raise ValueError(f"{key}: {exc}") from None
    return str(value)


def _flag(key: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"{key}: expected true or false, got {_kind(value)} {value!r}")
    return value


def _epochs(key: str, value: Any) -> int | None:
    return None if value is None else _integer(key, value, minimum=1)


def _aggregator(key: str, value: Any) -> str:
    from peer.averaging.robust import AGGREGATORS

    if not isinstance(value, str) or value not in AGGREGATORS:
        raise ValueError(f"{key}: expected one of {', '.join(AGGREGATORS)}, got {value!r}")
    return value


def _weight_bound(key: str, value: Any) -> float | None:
    if value is None:
        return None
    number = _number(key, value)
    if number < 1:
        raise ValueError(f"{key}: a factor of the group's median weight, at least 1; got {value}")
    return number


_FIELD_CHECKS: dict[str, Callable[[str, Any], Any]] = {
    "target_batch_size": functools.partial(_integer, minimum=1),
    "batch_size": functools.partial(_integer, minimum=1),
    "optimizer": _optimizer,
    "lr": _positive,
    "momentum": _fraction,
    "weight_decay": _non_negative,
    "epochs": _epochs,
    "checkpoint_every": functools.partial(_integer, minimum=0),
    "seed": functools.partial(_integer, minimum=0, maximum=2**63 - 1),
    "matchmaking_time": _positive,
    "averaging_timeout": _positive,
    "max_machines": functools.partial(_integer, minimum=1, maximum=10_000),
    "aggregator": _aggregator,
    "relative_weight_bound": _weight_bound,
    "algorithm": _algorithm,
    "inner_steps": functools.partial(_integer, minimum=1, maximum=1_000_000),
    "outer_lr": _positive,
    "outer_momentum": _fraction,
    "fragments": functools.partial(_integer, minimum=1, maximum=1024),
    "compression": _compression,
    "overlap": _flag,
}


def _check_like(key: str, value: Any, default: Any) -> Any:
    """A task parameter must have its default's type (an int where a float is expected is
    taken; a default of None accepts anything)."""
    if default is None or value is default:
        return value
    if isinstance(default, bool):
        if not isinstance(value, bool):
            raise ValueError(f"{key}: expected true or false, got {_kind(value)} {value!r}")
        return value
    if isinstance(default, int):
        return _integer(key, value)
    if isinstance(default, float):
        return _number(key, value)
    if isinstance(default, str):
        if not isinstance(value, str):
            raise ValueError(f"{key}: expected a string, got {_kind(value)} {value!r}")
        return value
    return value
