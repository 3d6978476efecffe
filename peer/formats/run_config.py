"""The settings every run shares, and their checks: one schema for the coordinator and peers.

A run's config is a flat JSON object. Its keys are either the settings below (how peers
train and average: :data:`BASE_DEFAULTS` names each with its default) or the task's own
parameters, which only the task knows. The coordinator checks the first kind where runs are
made (``check_run_settings``: a bad value is a 422 and no run); every peer checks both when
it builds its ``peer.tasks.TrainingConfig`` from the run. The checks are the same functions
on both sides, so an organizer hears of a mistake when creating the run, not from each
volunteer's exit.

Torch-free by design (the coordinator does not install torch): the names of aggregators and
codecs are listed here, and the peer library's registries are tested to match them.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Literal, get_args

from peer.formats.open_types import ConfigValues

__all__ = [
    "AGGREGATORS",
    "ALGORITHMS",
    "BASE_DEFAULTS",
    "COMPRESSIONS",
    "COMPRESSION_ALIASES",
    "FIELD_CHECKS",
    "LR_SCHEDULES",
    "OPTIMIZERS",
    "PRECISIONS",
    "AlgorithmName",
    "LRScheduleName",
    "OptimizerName",
    "PrecisionName",
    "check_like",
    "check_run_settings",
]

OptimizerName = Literal["sgd", "adam", "adamw"]
OPTIMIZERS: tuple[str, ...] = get_args(OptimizerName)
# how peers combine their work: "collaborative" (peer.Optimizer: a global batch, averaged
# gradients every epoch) or "diloco" (peer.DiLoCo: inner_steps local steps, then an outer
# step on the averaged pseudo-gradient; the choice for home links)
AlgorithmName = Literal["collaborative", "diloco"]
ALGORITHMS: tuple[str, ...] = get_args(AlgorithmName)
# the dtype of the forward pass: "fp32", or "bf16" (autocast on CPU and CUDA; parameters,
# gradients, optimizer state and averaging stay float32)
PrecisionName = Literal["fp32", "bf16"]
PRECISIONS: tuple[str, ...] = get_args(PrecisionName)
# the learning rate over the swarm's epochs, after warmup_epochs of linear warm-up: kept
# ("constant"), or decayed to 0 at the run's last epoch ("linear", "cosine")
LRScheduleName = Literal["constant", "linear", "cosine"]
LR_SCHEDULES: tuple[str, ...] = get_args(LRScheduleName)
# how reducers combine contributions (peer.averaging.allreduce.robust.AGGREGATORS)
AGGREGATORS: tuple[str, ...] = ("mean", "trimmed_mean", "centered_clip")
# the codecs' wire names (peer.compression.LEAF_CODECS) and the short names runs may use
COMPRESSIONS: tuple[str, ...] = (
    "none",
    "float16",
    "scaled_float16",
    "bfloat16",
    "uniform_8bit",
    "quantile_8bit",
    "blockwise_8bit",
    "blockwise_4bit",
)
COMPRESSION_ALIASES: Mapping[str, str] = MappingProxyType(
    {"fp16": "float16", "bf16": "bfloat16", "int8": "blockwise_8bit", "int4": "blockwise_4bit"}
)

# The values a setting takes when neither the run nor the task sets it.
BASE_DEFAULTS: ConfigValues = MappingProxyType(
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
        "group_size": None,
        "algorithm": "collaborative",
        "inner_steps": 100,
        "outer_lr": 0.7,
        "outer_momentum": 0.9,
        "fragments": 1,
        "compression": "none",
        "overlap": False,
        "local_buffers": False,
        "recompute_statistics": 0,
        "accumulation": 1,
        "precision": "fp32",
        "max_grad_norm": None,
        "lr_schedule": "constant",
        "warmup_epochs": 0,
    }
)


def check_run_settings(config: ConfigValues) -> dict[str, object]:
    """``config`` with each of its shared settings checked and normalised (``512.0`` → 512);
    the task's own keys pass through unchecked. ``ValueError`` naming the key otherwise, in
    one line for the organizer. Settings that depend on each other (``fragments`` at most
    ``inner_steps``) are checked with the defaults filling what the config leaves out."""
    if not isinstance(config, Mapping):
        raise ValueError(f"a run's config is a mapping of settings, not {_kind(config)}")
    checked = {
        key: FIELD_CHECKS[key](key, value) if key in FIELD_CHECKS else value
        for key, value in config.items()
    }
    check_together({**BASE_DEFAULTS, **checked})
    return checked


def check_together(settings: ConfigValues) -> None:
    """The checks across settings, on a complete set of checked values."""
    if settings["fragments"] > settings["inner_steps"]:
        raise ValueError(
            f"fragments: at most inner_steps ({settings['inner_steps']}), each fragment syncs "
            f"after an inner step of its own; got {settings['fragments']}"
        )
    epochs, warmup = settings["epochs"], settings["warmup_epochs"]
    if settings["lr_schedule"] != "constant" and epochs is None:
        raise ValueError(
            f"lr_schedule: {settings['lr_schedule']} decays to the run's last epoch; "
            "set epochs, or use constant"
        )
    if epochs is not None and warmup >= epochs:
        raise ValueError(f"warmup_epochs: less than epochs ({epochs}); got {warmup}")


def _kind(value: object) -> str:
    return "null" if value is None else type(value).__name__


def _integer(
    key: str, value: object, *, minimum: int | None = None, maximum: int | None = None
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


def _number(key: str, value: object) -> float:
    if not isinstance(value, int | float) or isinstance(value, bool):
        raise ValueError(f"{key}: expected a number, got {_kind(value)} {value!r}")
    if not math.isfinite(value):
        raise ValueError(f"{key}: must be finite, got {value}")
    return float(value)


def _positive(key: str, value: object) -> float:
    number = _number(key, value)
    if number <= 0:
        raise ValueError(f"{key}: must be positive, got {value}")
    return number


def _fraction(key: str, value: object) -> float:
    number = _number(key, value)
    if not 0.0 <= number < 1.0:
        raise ValueError(f"{key}: must be in [0, 1), got {value}")
    return number


def _non_negative(key: str, value: object) -> float:
    number = _number(key, value)
    if number < 0:
        raise ValueError(f"{key}: must not be negative, got {value}")
    return number


def _one_of(choices: tuple[str, ...], key: str, value: object) -> str:
    if not isinstance(value, str) or value not in choices:
        raise ValueError(f"{key}: expected one of {', '.join(choices)}, got {value!r}")
    return value


def _compression(key: str, value: object) -> str:
    if not isinstance(value, str):
        raise ValueError(f"{key}: a compression name must be a string, got {_kind(value)}")
    name = value.strip().lower()
    if COMPRESSION_ALIASES.get(name, name) in COMPRESSIONS:
        return value
    choices = ", ".join(sorted({*COMPRESSION_ALIASES, *COMPRESSIONS}))
    raise ValueError(f"{key}: unknown compression {value!r}; choose one of {choices}")


def _flag(key: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"{key}: expected true or false, got {_kind(value)} {value!r}")
    return value


def _epochs(key: str, value: object) -> int | None:
    return None if value is None else _integer(key, value, minimum=1)


def _max_norm(key: str, value: object) -> float | None:
    return None if value is None else _positive(key, value)


def _group_size(key: str, value: object) -> int | None:
    return None if value is None else _integer(key, value, minimum=2, maximum=10_000)


def _weight_bound(key: str, value: object) -> float | None:
    if value is None:
        return None
    number = _number(key, value)
    if number < 1:
        raise ValueError(f"{key}: a factor of the group's median weight, at least 1; got {value}")
    return number


FIELD_CHECKS: Mapping[str, Callable[[str, object], object]] = MappingProxyType(
    {
        "target_batch_size": functools.partial(_integer, minimum=1),
        "batch_size": functools.partial(_integer, minimum=1),
        "optimizer": functools.partial(_one_of, OPTIMIZERS),
        "lr": _positive,
        "momentum": _fraction,
        "weight_decay": _non_negative,
        "epochs": _epochs,
        "checkpoint_every": functools.partial(_integer, minimum=0),
        "seed": functools.partial(_integer, minimum=0, maximum=2**63 - 1),
        "matchmaking_time": _positive,
        "averaging_timeout": _positive,
        "max_machines": functools.partial(_integer, minimum=1, maximum=10_000),
        "aggregator": functools.partial(_one_of, AGGREGATORS),
        "relative_weight_bound": _weight_bound,
        "group_size": _group_size,
        "algorithm": functools.partial(_one_of, ALGORITHMS),
        "inner_steps": functools.partial(_integer, minimum=1, maximum=1_000_000),
        "outer_lr": _positive,
        "outer_momentum": _fraction,
        "fragments": functools.partial(_integer, minimum=1, maximum=1024),
        "compression": _compression,
        "overlap": _flag,
        "local_buffers": _flag,
        "recompute_statistics": functools.partial(_integer, minimum=0, maximum=10_000),
        "accumulation": functools.partial(_integer, minimum=1, maximum=1024),
        "precision": functools.partial(_one_of, PRECISIONS),
        "max_grad_norm": _max_norm,
        "lr_schedule": functools.partial(_one_of, LR_SCHEDULES),
        "warmup_epochs": functools.partial(_integer, minimum=0, maximum=1_000_000),
    }
)
assert set(FIELD_CHECKS) == set(BASE_DEFAULTS), "every shared setting has a default and a check"


def check_like(key: str, value: object, default: object) -> object:
    """A task parameter must have its default's type (an int where a float is expected is
    taken; a default of None accepts anything)."""
    if default is None or value is default:
        return value
    if isinstance(default, bool):
        return _flag(key, value)
    if isinstance(default, int):
        return _integer(key, value)
    if isinstance(default, float):
        return _number(key, value)
    if isinstance(default, str):
        if not isinstance(value, str):
            raise ValueError(f"{key}: expected a string, got {_kind(value)} {value!r}")
        return value
    return value
