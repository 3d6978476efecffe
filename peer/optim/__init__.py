"""Optimizers that train one model across the swarm, a folder each.

* :mod:`peer.optim.collaborative` — ``Optimizer``: a global batch size, averaged gradients;
* :mod:`peer.optim.decentralized` — ``DecentralizedOptimizer``/``SGD``/``Adam``: local steps,
  background averaging, swarm epochs;
* :mod:`peer.optim.diloco` — ``DiLoCo``: H inner steps, then an outer step on the swarm's
  mean pseudo-gradient;
* :mod:`peer.optim.hierarchy` — ``HierarchicalModelAverager``, ``DASO`` and
  ``DataParallelOptimizer``: a machine's processes and the swarm;
* :mod:`peer.optim.shared` — what they share: the swarm's epoch, catching up with it, the
  live state.
"""

from __future__ import annotations

from peer.optim.buffers import model_buffers
from peer.optim.decentralized.optimizers import (
    DecentralizedAdam,
    DecentralizedConfig,
    DecentralizedOptimizer,
    DecentralizedSGD,
)
from peer.optim.diloco.outer import DiLoCo
from peer.optim.hierarchy.daso import DASO, DataParallelOptimizer
from peer.optim.hierarchy.hierarchical import HierarchicalModelAverager
from peer.optim.shared.progress import (
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
