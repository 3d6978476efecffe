"""Optimizers that train one model across the swarm.

* :mod:`peer.optim.collaborative` — ``Optimizer``: a global batch size, averaged gradients
  (its epoch's phases: :mod:`~peer.optim.epochs`, :mod:`~peer.optim.phases`,
  :mod:`~peer.optim.rounds`; its live state: :mod:`~peer.optim.live_state`,
  :mod:`~peer.optim.optimizer_state`);
* :mod:`peer.optim.decentralized` — ``DecentralizedOptimizer``/``SGD``/``Adam``: local steps,
  background averaging, swarm epochs;
* :mod:`peer.optim.diloco` — ``DiLoCo``: H inner steps, then an outer step on the swarm's
  mean pseudo-gradient (schedule: :mod:`~peer.optim.diloco_schedule`);
* :mod:`peer.optim.hierarchical` — ``HierarchicalModelAverager``; :mod:`peer.optim.daso` —
  ``DASO`` and ``DataParallelOptimizer``; both average over :mod:`peer.optim.levels`;
* shared by all: :mod:`peer.optim.progress` (the swarm's epoch) and :mod:`peer.optim.catchup`
  (catching up with it).
"""

from __future__ import annotations

from peer.optim.buffers import model_buffers
from peer.optim.daso import DASO, DataParallelOptimizer
from peer.optim.decentralized import (
    DecentralizedAdam,
    DecentralizedConfig,
    DecentralizedOptimizer,
    DecentralizedSGD,
)
from peer.optim.diloco import DiLoCo
from peer.optim.hierarchical import HierarchicalModelAverager
from peer.optim.progress import (
    PerformanceEMA,
    ProgressReport,
    ProgressTracker,
    SwarmProgress,
    compute_swarm_progress,
)

__all__ = [
    "DASO",
    "DataParallelOptimizer",
    "DecentralizedAdam",
    "DecentralizedConfig",
    "DecentralizedOptimizer",
    "DecentralizedSGD",
    "DiLoCo",
    "HierarchicalModelAverager",
    "PerformanceEMA",
    "ProgressReport",
    "ProgressTracker",
    "SwarmProgress",
    "compute_swarm_progress",
    "model_buffers",
]
