"""Optimizers that train one model across the swarm.

* :mod:`peer.optim.progress` — progress reports and the swarm's epoch (pure logic + tracker),
  shared by both training loops;
* :mod:`peer.optim.catchup` — catching up with the swarm (download the newest state, or go
  on with one's own), one policy for every optimizer that counts swarm epochs;
* :mod:`peer.optim.collaborative` — ``Optimizer``: a global batch size, averaged gradients;
  its options (:mod:`peer.optim.options`), the phases ending an epoch
  (:mod:`peer.optim.epochs` plans them, :mod:`peer.optim.phases` runs them, one round at a
  time: :mod:`peer.optim.rounds`; in the background: :mod:`peer.optim.pending`), the
  gradients between rounds (:mod:`peer.optim.accumulation`) and the live state it averages
  and shares (:mod:`peer.optim.live_state`, :mod:`peer.optim.state`);
* :mod:`peer.optim.decentralized` — ``DecentralizedOptimizer``/``SGD``/``Adam``: local steps,
  background averaging, swarm epochs;
* :mod:`peer.optim.hierarchical` — ``HierarchicalModelAverager`` (periods per level: the
  machine's ``torch.distributed`` subgroups, then the swarm);
* :mod:`peer.optim.daso` — ``DASO`` (frequent local, asynchronous global syncs; the
  schedule in :mod:`peer.optim.daso_schedule`) and ``DataParallelOptimizer``;
* :mod:`peer.optim.diloco` — ``DiLoCo``: H inner steps, then an outer step on the swarm's
  mean pseudo-gradient; streamed fragments, overlap, compression (the schedule in
  :mod:`peer.optim.diloco_schedule`, one sync's round in :mod:`peer.optim.diloco_rounds`,
  :mod:`peer.optim.error_feedback`);
* :mod:`peer.optim.levels` — the two levels those average over (local world, swarm).
"""

from __future__ import annotations

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
]
