"""Local steps with background averaging: ``DecentralizedOptimizer``, ``DecentralizedSGD``,
``DecentralizedAdam``.

:mod:`~.optimizers` holds the optimizers, :mod:`~.averaging_thread` their background
rounds, :mod:`~.averaged_copies` what those rounds average, and :mod:`~.state_layout` the
wrapped optimizer's state as a newcomer downloads it.
"""

from __future__ import annotations

from peer.optim.decentralized.optimizers import (
    DecentralizedAdam,
    DecentralizedConfig,
    DecentralizedOptimizer,
    DecentralizedSGD,
)

__all__ = ["DecentralizedAdam", "DecentralizedConfig", "DecentralizedOptimizer", "DecentralizedSGD"]
