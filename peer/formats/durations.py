"""Durations as people type them on both command lines (``swarmgrad invite --expires 7d``,
``swarmgrad coordinator tokens create --expires-in 12h``)."""

from __future__ import annotations

import re

_DURATION = re.compile(r"(\d+(?:\.\d+)?)\s*([smhdw])")
_UNIT_SECONDS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}


def parse_duration(text: str) -> float:
    """``"30m"``, ``"12h"``, ``"7d"`` (also ``s`` and ``w``) in seconds; ValueError otherwise."""
    match = _DURATION.fullmatch(text.strip().lower())
    if match is None or float(match.group(1)) <= 0:
        raise ValueError(f"{text!r} is not a duration like 30m, 12h or 7d")
    return float(match.group(1)) * _UNIT_SECONDS[match.group(2)]
