"""Shared test settings.

``SWARMGRAD_TEST_TIME_SCALE`` stretches every bounded wait in the tests (e.g. 3 on a slow
machine); it is the one timing knob, instead of sleeps sprinkled with magic numbers.
"""

from __future__ import annotations

import os

TIME_SCALE = float(os.environ.get("SWARMGRAD_TEST_TIME_SCALE", "1"))


def scaled(seconds: float) -> float:
    return seconds * TIME_SCALE
