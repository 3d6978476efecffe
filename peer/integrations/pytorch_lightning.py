"""``SwarmgradStrategy`` for ``pytorch_lightning.Trainer``: the seed's import path.

``pytorch_lightning`` and ``lightning.pytorch`` ship the same Trainer under two names, each
accepting only strategies derived from its own ``Strategy``. This ``SwarmgradStrategy`` is
that of :mod:`peer.integrations.lightning` (one implementation,
:class:`~peer.integrations.lightning_strategy.SwarmgradStrategyBase`) on
``pytorch_lightning.strategies.Strategy``::

    import pytorch_lightning as pl
    from peer.integrations.pytorch_lightning import SwarmgradStrategy

    pl.Trainer(strategy=SwarmgradStrategy(target_batch_size=4096)).fit(model)

Needs ``pytorch_lightning`` (``pip install pytorch-lightning``) besides ``lightning``
(``pip install 'swarmgrad[lightning]'``); without it, importing this module says so.
"""

from __future__ import annotations

from peer.exceptions import SwarmgradError

try:
    from pytorch_lightning.strategies import Strategy
except ModuleNotFoundError:
    raise SwarmgradError(
        "this SwarmgradStrategy is for pytorch_lightning.Trainer, which is not installed: "
        "pip install pytorch-lightning, or use lightning.pytorch.Trainer with "
        "peer.integrations.lightning.SwarmgradStrategy"
    ) from None

from peer.integrations.lightning_strategy import (
    LightningPackage,
    SwarmgradStrategyBase,
    SwarmScheduler,
)

__all__ = ["SwarmScheduler", "SwarmgradStrategy"]


# The type checker reads the shared methods against lightning.pytorch's Strategy (the base
# SwarmgradStrategyBase declares for it); pytorch_lightning's is the same class under the other
# package's name, its attributes typed with that package's classes: to the checker, two bases
# that disagree on every attribute.
class SwarmgradStrategy(SwarmgradStrategyBase, Strategy):  # type: ignore[misc]
    """Collaborative training across the swarm, for ``pytorch_lightning.Trainer`` (see
    :mod:`peer.integrations.lightning`)."""

    lightning_package = LightningPackage.load("pytorch_lightning")
