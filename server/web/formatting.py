"""The pages' number and time formats for the first, server-side render: the same rules, and
the same text, as ``web/static/js/format.js``, which keeps the pages live (a browser test
checks that both write the same text for the same values).

Counts get thousands separators; rates are whole numbers from 100 up, one decimal below and
two below 1; measured values four significant digits; durations and relative times grow
("45 s", "12 min", "3 h 5 min"; "just now", "3 min ago"); wall-clock times are UTC, 24-hour,
with the zone written."""

from __future__ import annotations

import math
from datetime import UTC, datetime
from typing import SupportsFloat, SupportsIndex

from jinja2 import Environment

DASH = "\u2013"  # an en dash: no value


def _finite(value: object) -> float | None:
    if isinstance(value, bool) or not isinstance(value, SupportsFloat | SupportsIndex | str):
        return None
    try:
        x = float(value)
    except (TypeError, ValueError):
        return None
    return x if math.isfinite(x) else None


def _round(x: float) -> int:
    """JavaScript's Math.round: halves go up."""
    return math.floor(x + 0.5)


def integer(value: object) -> str:
    x = _finite(value)
    return DASH if x is None else f"{_round(x):,}"


def rate(value: object) -> str:
    x = _finite(value)
    if x is None:
        return DASH
    a = abs(x)
    if a >= 100:
        return integer(x)
    if a >= 1:
        return f"{x:.1f}"
    if a == 0:
        return "0"
    return f"{x:.2f}"


def measure(value: object) -> str:
    x = _finite(value)
    if x is None:
        return DASH
    a = abs(x)
    if a == 0:
        return "0"
    if a >= 1000:
        return integer(x)
    digits = min(8, max(0, 3 - math.floor(math.log10(a))))
    return f"{x:.{digits}f}"


def percent(fraction: object) -> str:
    x = _finite(fraction)
    if x is None:
        return DASH
    p = x * 100
    if 0 < p < 0.1:
        return "<0.1 %"
    return f"{p:.1f} %"


def duration(seconds: object) -> str:
    x = _finite(seconds)
    if x is None:
        return DASH
    s = max(0, _round(x))
    if s < 60:
        return f"{s} s"
    m = s // 60
    if m < 60:
        return f"{m} min"
    h = m // 60
    if h < 24:
        return f"{h} h {m % 60} min" if m % 60 else f"{h} h"
    d = h // 24
    return f"{d} d {h % 24} h" if h % 24 else f"{d} d"


def ago(seconds: object) -> str:
    x = _finite(seconds)
    if x is None:
        return "never"
    s = max(0, math.floor(x))
    if s < 10:
        return "just now"
    if s < 60:
        return f"{s} s ago"
    m = s // 60
    if m < 60:
        return f"{m} min ago"
    h = m // 60
    if h < 24:
        return f"{h} h ago"
    return f"{h // 24} d ago"


def eta(seconds: object) -> str:
    x = _finite(seconds)
    if x is None:
        return DASH
    if x == 0:
        return "reached"
    return duration(math.ceil(x))


def _utc(value: datetime) -> datetime:
    return value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)


def when(value: datetime | None) -> str:
    """``2026-11-26 22:53:07 UTC``."""
    if value is None:
        return "never"
    return _utc(value).strftime("%Y-%m-%d %H:%M:%S UTC")


def iso(value: datetime | None) -> str:
    """For ``<time datetime=...>``: ISO 8601 in UTC, with its ``Z``."""
    if value is None:
        return ""
    return _utc(value).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def since(value: datetime | None, now: datetime) -> str:
    """How long ago ``value`` was, at ``now``."""
    if value is None:
        return "never"
    return ago((_utc(now) - _utc(value)).total_seconds())


def clock(unix_seconds: float) -> str:
    """A chart point's time: ``22:53:07`` (UTC, said by the table's heading)."""
    return datetime.fromtimestamp(unix_seconds, UTC).strftime("%H:%M:%S")


FILTERS = {
    "clock": clock,
    "integer": integer,
    "rate": rate,
    "measure": measure,
    "percent": percent,
    "duration": duration,
    "ago": ago,
    "eta": eta,
    "when": when,
    "iso": iso,
}


def install(environment: Environment) -> None:
    environment.filters.update(FILTERS)
    environment.globals["since"] = since
    environment.globals.update(integer=integer, rate=rate, measure=measure)
