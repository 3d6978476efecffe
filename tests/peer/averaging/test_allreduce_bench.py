"""bench/allreduce.py runs end to end, tiny and short, on loopback and on links shaped with
tc (the figures are the benchmark's to report, not checked here)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from swarmlab.netlab import unavailable
from tests.conftest import scaled

BENCH = Path(__file__).resolve().parents[3] / "bench" / "allreduce.py"
ROW = re.compile(r"^\s+2\s+(on|off)\s+[\d.]+\s+[\d.]+\s+([\d.]+)\s", re.M)


def _bench(*extra: str) -> str:
    done = subprocess.run(
        [sys.executable, str(BENCH), "--peers", "2", "--mb", "1", "--reps", "2", *extra],
        capture_output=True,
        text=True,
        timeout=scaled(300),
        stdin=subprocess.DEVNULL,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


@pytest.mark.slow
@pytest.mark.parametrize("where", ["loopback", "shaped links"])
def test_the_allreduce_benchmark_prints_both_settings_against_gloo(where: str) -> None:
    extra: tuple[str, ...] = ()
    if where == "shaped links":
        reason = unavailable()
        if reason is not None:
            if os.environ.get("CI", "").lower() == "true":
                pytest.fail(f"the shaped-link benchmark is needed in CI: {reason}", pytrace=False)
            pytest.skip(reason)
        extra = ("--rate", "200")
    out = _bench(*extra)
    rows = dict(ROW.findall(out))
    assert set(rows) == {"on", "off"}, out
    assert all(float(ratio) > 0 for ratio in rows.values()), out
    assert ("200 Mbit/s" in out) == (where == "shaped links"), out
