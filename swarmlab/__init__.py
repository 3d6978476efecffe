"""Support for the tests and benchmarks: simulators, fault injection, network emulation and
comparison helpers. It lives beside the product packages and is not part of the wheel; the
benchmarks and tests import it from the repository root."""

from __future__ import annotations

import os
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def child_env() -> dict[str, str]:
    """Extra environment for a child process that imports :mod:`swarmlab` whatever its
    working directory: the repository root ahead of the inherited ``PYTHONPATH``."""
    inherited = os.environ.get("PYTHONPATH")
    return {"PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), inherited) if p)}
