"""Wall-clock helpers. Integer Unix milliseconds are what the database compares.

Several workers can only share the wall clock, so that is what orders reports and
snapshots. Within one process, :func:`now_ms` never goes backwards even if the system clock
is stepped back (it then stands still until the clock catches up), so a process never
mistakes its own newer report for an older one.
"""

from __future__ import annotations

import threading
import time
from datetime import UTC, datetime


class _NonDecreasingClock:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._last = 0

    def __call__(self) -> int:
        now = time.time_ns() // 1_000_000
        with self._lock:
            if now < self._last:
                return self._last
            self._last = now
            return now


now_ms = _NonDecreasingClock()


def ms_to_datetime(ms: int) -> datetime:
    return datetime.fromtimestamp(ms / 1000, UTC)
