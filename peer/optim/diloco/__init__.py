"""``peer.DiLoCo``: many local steps, then one outer step on the swarm's mean pseudo-gradient.

:mod:`~.outer` is the optimizer, :mod:`~.sync_schedule` its schedule (without I/O),
:mod:`~.sync` one sync's round, :mod:`~.error_feedback` the residual of compressed
pseudo-gradients.
"""

from __future__ import annotations

from peer.optim.diloco.outer import DiLoCo

__all__ = ["DiLoCo"]
