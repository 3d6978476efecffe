"""``SwarmgradStrategy``: train a ``LightningModule`` collaboratively with ``peer.Optimizer``.

Hand it to a ``Trainer`` and every machine that runs the same script joins one swarm::

    trainer = Trainer(strategy=SwarmgradStrategy(target_batch_size=4096))
    trainer.fit(model)   # logs the line another machine runs to join

Its arguments follow Lightning's ``HivemindStrategy`` (the module's optimizer stepped once
the swarm processed ``target_batch_size`` samples; peers from ``initial_peers`` or
``PL_INITIAL_PEERS``); ``algorithm="diloco"`` trains with :class:`~peer.DiLoCo` instead, and
``coordinator=URL, token=T`` joins a coordinator's run as ``swarmgrad join`` does. Every
argument: :class:`~peer.integrations.lightning_strategy.SwarmgradStrategyBase`. For
``pytorch_lightning.Trainer`` import it from :mod:`peer.integrations.pytorch_lightning`.

Needs the ``lightning`` package: ``pip install 'swarmgrad[lightning]'``.
"""

from __future__ import annotations

from peer.exceptions import SwarmgradError

try:
    from lightning.pytorch.strategies import Strategy
except ModuleNotFoundError:
    raise SwarmgradError(
        "SwarmgradStrategy needs Lightning: pip install 'swarmgrad[lightning]'"
    ) from None

from peer.integrations.lightning_strategy import (
    LightningPackage,
    SwarmgradStrategyBase,
    SwarmScheduler,
)

__all__ = ["SwarmScheduler", "SwarmgradStrategy"]


class SwarmgradStrategy(SwarmgradStrategyBase, Strategy):
    """Collaborative training across the swarm, for ``lightning.pytorch.Trainer`` (see the
    module docstring)."""

    lightning_package = LightningPackage.load("lightning.pytorch")
