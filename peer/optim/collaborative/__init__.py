"""``peer.Optimizer``: collaborative training with a global batch size.

:mod:`~.optimizer` is the optimizer; an epoch's end is planned in :mod:`~.epochs`, its
phases run in :mod:`~.phases`, each averaging round in :mod:`~.rounds`; gradients between
rounds accumulate in :mod:`~.accumulation`; :mod:`~.options` checks the options.
"""

from __future__ import annotations

from peer.optim.collaborative.optimizer import Optimizer

__all__ = ["Optimizer"]
