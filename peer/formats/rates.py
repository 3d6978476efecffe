"""Rates counted from counters: how fast a count grew over an observer's own clock.

A training rate is counted, never taken from what a peer claims: the growth of a samples
counter over the last :data:`RATE_WINDOW_S` seconds of the observer's clock. The
coordinator's dashboard counts a run's and each machine's samples/s that way from the
reports it receives; a volunteer counts its own samples and the swarm's (from the gossiped
progress records) the same way, with :class:`CountedRate`, so its line and the dashboard
show the same measured rates.

The rule: from the newest point at least :data:`RATE_WINDOW_S` older than the latest (else
the oldest, for a young counter) to the latest; no rate over less than
:data:`MIN_RATE_SPAN_S`. Pure: the caller passes its clock's readings.
"""

from __future__ import annotations

from collections import deque

__all__ = ["MIN_RATE_SPAN_S", "RATE_WINDOW_S", "CountedRate", "rate_between"]

# The span a rate is counted over: long enough that a counter reported in steps of a few
# seconds reads steady, short enough to follow a change within a few lines of a log.
RATE_WINDOW_S = 10.0
# Nor over less than this: a counter seen for less has no rate yet.
MIN_RATE_SPAN_S = 1.0


def rate_between(
    start: tuple[float, float], end: tuple[float, float], *, min_span: float = MIN_RATE_SPAN_S
) -> float | None:
    """Count per second from ``start`` to ``end``, each ``(time in seconds, count)``; None
    when they are less than ``min_span`` apart. A count that fell counts as no growth."""
    span = end[0] - start[0]
    if span < min_span or span <= 0:
        return None
    return max(0.0, end[1] - start[1]) / span


class CountedRate:
    """A counter's rate by the rule of the module docstring. :meth:`add` a reading of the
    counter whenever it is convenient (every second or so); :attr:`per_second` is the rate
    up to the latest reading. Keeps only the readings the window needs."""

    def __init__(self, window: float = RATE_WINDOW_S, min_span: float = MIN_RATE_SPAN_S) -> None:
        if window <= 0 or min_span <= 0:
            raise ValueError("a rate's window and minimum span must be positive")
        self.window = float(window)
        self.min_span = float(min_span)
        self._points: deque[tuple[float, float]] = deque()

    def add(self, now: float, count: float) -> None:
        """A reading: ``count`` at ``now`` (seconds on the caller's clock, never going back;
        a reading from before the latest one is ignored)."""
        points = self._points
        if points and now < points[-1][0]:
            return
        points.append((float(now), float(count)))
        # the oldest point still needed is the newest one at least a window old
        while len(points) > 1 and points[1][0] <= now - self.window:
            points.popleft()

    @property
    def per_second(self) -> float | None:
        """The count's growth per second over the window; None until the readings span
        ``min_span``."""
        if len(self._points) < 2:
            return None
        return rate_between(self._points[0], self._points[-1], min_span=self.min_span)

    def clear(self) -> None:
        """Forget every reading (the counter restarts)."""
        self._points.clear()
