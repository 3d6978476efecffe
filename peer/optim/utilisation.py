"""Compute utilisation: the share of a training loop's time spent computing, not waiting.

A loop alternates forward/backward passes and ``opt.step()`` calls. Most calls of a swarm
optimizer are its own local work (accumulating gradients, an inner optimizer step); a few
also wait for the network (an averaging round that has not finished). The meter counts a
call's time beyond the median call as waiting, so::

    utilisation = (forward/backward time + calls x median call) / (forward/backward + calls)

Pure bookkeeping (no clock of its own): the caller times its loop and adds the figures.
Used by ``swarmgrad join``'s progress reports and by ``bench/wan.py``.
"""

from __future__ import annotations

import math
import statistics

__all__ = ["ComputeMeter"]


class ComputeMeter:
    """Forward/backward seconds and step() call durations since the last :meth:`take`."""

    def __init__(self) -> None:
        self.compute = 0.0
        self.calls: list[float] = []

    def add(self, compute_seconds: float, step_seconds: float) -> None:
        """One iteration: ``compute_seconds`` in forward/backward, ``step_seconds`` in
        ``opt.step()`` (and ``zero_grad``)."""
        if not (math.isfinite(compute_seconds) and math.isfinite(step_seconds)):
            raise ValueError("durations must be finite")
        if compute_seconds < 0 or step_seconds < 0:
            raise ValueError("durations must not be negative")
        self.compute += compute_seconds
        self.calls.append(step_seconds)

    @property
    def waiting(self) -> float:
        """Seconds of step() calls beyond the median call."""
        if not self.calls:
            return 0.0
        median = statistics.median(self.calls)
        return sum(max(0.0, c - median) for c in self.calls)

    def utilisation(self) -> float | None:
        """The fraction of the loop's time spent computing, in [0, 1]; None before the
        first iteration (or when no time passed)."""
        total = self.compute + sum(self.calls)
        if not self.calls or total <= 0:
            return None
        return min(1.0, max(0.0, (total - self.waiting) / total))

    def take(self) -> float | None:
        """:meth:`utilisation`, then start over."""
        value = self.utilisation()
        self.compute, self.calls = 0.0, []
        return value
