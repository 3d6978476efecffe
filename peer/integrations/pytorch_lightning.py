"""``SwarmgradStrategy`` for ``pytorch_lightning.Trainer``: the seed's import path.

``pytorch_lightning`` and ``lightning.pytorch`` ship the same Trainer under two names, and each
accepts only strategies derived from its own ``Strategy`` class (the other's is refused as an
"invalid strategy name"). :class:`SwarmgradStrategy` here is the strategy of
:mod:`peer.integrations.lightning` — the same methods, the same arguments, the same tests —
built on ``pytorch_lightning.strategies.Strategy``, with Lightning's helpers taken from
``pytorch_lightning`` too::

    import pytorch_lightning as pl
    from peer.integrations.pytorch_lightning import SwarmgradStrategy

    pl.Trainer(strategy=SwarmgradStrategy(target_batch_size=4096)).fit(model)

Needs the ``pytorch_lightning`` package (``pip install pytorch-lightning``) besides
``lightning`` (``pip install 'swarmgrad[lightning]'``); without it, importing this module says
so and names the other way.
"""

from __future__ import annotations

import types
from typing import Any

from peer.exceptions import SwarmgradError

try:
    from pytorch_lightning.strategies import Strategy
    from pytorch_lightning.utilities.data import extract_batch_size
    from pytorch_lightning.utilities.exceptions import MisconfigurationException
    from pytorch_lightning.utilities.model_helpers import is_overridden
    from pytorch_lightning.utilities.rank_zero import rank_zero_warn
except ModuleNotFoundError:
    raise SwarmgradError(
        "this SwarmgradStrategy is for pytorch_lightning.Trainer, which is not installed: "
        "pip install pytorch-lightning, or use lightning.pytorch.Trainer with "
        "peer.integrations.lightning.SwarmgradStrategy"
    ) from None

from peer.integrations import lightning as _lightning
from peer.integrations.lightning import SwarmScheduler

__all__ = ["SwarmScheduler", "SwarmgradStrategy"]

# The names the strategy's methods look up in their module, as pytorch_lightning has them.
_HELPERS: dict[str, Any] = {
    "Strategy": Strategy,
    "extract_batch_size": extract_batch_size,
    "MisconfigurationException": MisconfigurationException,
    "is_overridden": is_overridden,
    "rank_zero_warn": rank_zero_warn,
}


def _rebuilt(template: type, base: type, helpers: dict[str, Any]) -> type:
    """``template``'s own methods and properties on ``base`` instead of ``template``'s base,
    each function looking its module's names up in a copy with ``helpers`` and its
    ``super()`` bound to the new class."""
    namespace = vars(__import__(template.__module__, fromlist=["_"])).copy()
    namespace.update(helpers)
    owner = types.CellType()  # the new class, once it exists: what super() uses

    def rebind(function: types.FunctionType) -> types.FunctionType:
        closure = function.__closure__
        if closure is not None:
            closure = tuple(
                owner if name == "__class__" else cell
                for name, cell in zip(function.__code__.co_freevars, closure, strict=True)
            )
        copy = types.FunctionType(
            function.__code__, namespace, function.__name__, function.__defaults__, closure
        )
        copy.__kwdefaults__ = function.__kwdefaults__
        copy.__qualname__ = function.__qualname__
        copy.__doc__ = function.__doc__
        copy.__annotations__ = dict(function.__annotations__)
        copy.__module__ = __name__
        return copy

    def convert(value: Any) -> Any:
        if isinstance(value, types.FunctionType):
            return rebind(value)
        if isinstance(value, property):
            fget, fset, fdel = (
                None if f is None else convert(f) for f in (value.fget, value.fset, value.fdel)
            )
            return property(fget, fset, fdel, value.__doc__)
        if isinstance(value, staticmethod | classmethod):
            return type(value)(convert(value.__func__))
        return value

    body = {
        name: convert(value)
        for name, value in vars(template).items()
        if name not in ("__dict__", "__weakref__")
    }
    body["__module__"] = __name__
    rebuilt = type(template.__name__, (base,), body)
    owner.cell_contents = rebuilt
    return rebuilt


SwarmgradStrategy: type[Any] = _rebuilt(_lightning.SwarmgradStrategy, Strategy, _HELPERS)
