"""Compute utilisation: the share of a training loop's time spent computing, not waiting.

A loop alternates forward/backward passes and ``opt.step()`` calls; a call's time beyond
its local work (accumulating gradients, an optimizer step) is waiting for the network::

    utilisation = (forward/backward + calls - waiting) / (forward/backward + calls)

:class:`ComputeMeter` is pure bookkeeping (no clock of its own): the caller times its loop
and adds the figures. Used by ``swarmgrad join``'s progress reports and ``bench/wan.py``.
"""

from __future__ import annotations

import math

__all__ = ["ComputeMeter"]


class ComputeMeter:
    """Forward/backward seconds and step() call durations since the last :meth:`take`;
    ``reference``: the seconds of a call's local work, if measured.

    A call's local work is what the optimizer timed of it when it times its own inner step
    (``local`` in :meth:`add`: DiLoCo's ``inner_step_seconds``, taken under the same load as
    the rest of the call), else ``reference`` when the caller measured it (the wrapped
    optimizer's step on this model, as ``bench/wan.py`` does), else the tenth percentile of
    the calls: most calls of DiLoCo are inner steps and most calls of the collaborative
    Optimizer accumulate gradients (with a batch or less per peer per epoch, every call
    averages and only a measured ``reference`` tells the waiting apart)."""

    def __init__(self, reference: float | None = None) -> None:
        if reference is not None and not (math.isfinite(reference) and reference >= 0):
            raise ValueError("reference must be a non-negative number of seconds")
        self.reference = reference
        self.compute = 0.0
        self.calls: list[float] = []
        self.local: list[float | None] = []  # each call's local work, where it was timed

    def add(
        self, compute_seconds: float, step_seconds: float, local_seconds: float | None = None
    ) -> None:
        """One iteration: ``compute_seconds`` in forward/backward, ``step_seconds`` in
        ``opt.step()`` (and ``zero_grad``), of which ``local_seconds`` (if the optimizer
        timed it) its own local work."""
        durations = [compute_seconds, step_seconds]
        if local_seconds is not None:
            durations.append(local_seconds)
        if not all(math.isfinite(d) for d in durations):
            raise ValueError("durations must be finite")
        if any(d < 0 for d in durations):
            raise ValueError("durations must not be negative")
        self.compute += compute_seconds
        self.calls.append(step_seconds)
        self.local.append(local_seconds)

    @property
    def local_step(self) -> float:
        """The seconds of a call's local work: ``reference``, else the calls' tenth
        percentile (0 before the first call)."""
        if self.reference is not None:
            return self.reference
        if not self.calls:
            return 0.0
        ordered = sorted(self.calls)
        return ordered[(len(ordered) - 1) // 10]

    @property
    def waiting(self) -> float:
        """Seconds of step() calls beyond their local work."""
        local = self.local_step
        return sum(
            max(0.0, c - (local if timed is None else timed))
            for c, timed in zip(self.calls, self.local, strict=True)
        )

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
        self.compute, self.calls, self.local = 0.0, [], []
        return value
