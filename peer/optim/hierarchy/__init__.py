"""Averaging at two levels, a machine's processes and the swarm.

:mod:`~.hierarchical` (``HierarchicalModelAverager``, hierarchical SGD) and :mod:`~.daso`
(``DASO``, ``DataParallelOptimizer``; its schedule in :mod:`~.daso_schedule`) both average
over the two levels of :mod:`~.levels`.
"""

from __future__ import annotations

from peer.optim.hierarchy.daso import DASO, DataParallelOptimizer
from peer.optim.hierarchy.hierarchical import HierarchicalModelAverager

__all__ = ["DASO", "DataParallelOptimizer", "HierarchicalModelAverager"]
