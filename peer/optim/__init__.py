"""Optimizers that train one model across the swarm.

* :mod:`peer.optim.progress` — progress reports and the swarm's epoch (pure logic + tracker);
* :mod:`peer.optim.decentralized` — ``DecentralizedOptimizer``/``SGD``/``Adam``: local steps,
  background averaging, swarm epochs.
"""

from __future__ import annotations

from peer.optim.decentralized import (
    DecentralizedAdam,
    DecentralizedConfig,
    DecentralizedOptimizer,
    DecentralizedSGD,
)
from peer.optim.progress import (
    PerformanceEMA,
    ProgressReport,
    ProgressTracker,
    SwarmProgress,
    compute_swarm_progress,
)

__all__ = [
    "DecentralizedAdam",
    "DecentralizedConfig",
    "DecentralizedOptimizer",
    "DecentralizedSGD",
    "PerformanceEMA",
    "ProgressReport",
    "ProgressTracker",
    "SwarmProgress",
    "compute_swarm_progress",
]
