"""The delays hide averaging behind compute: bench/overlap.py on links shaped with tc, in a
small configuration (an epoch takes about a second and a half), with its own ``--check`` of
the median ratio measured in the same run. Needs root and iproute2, as the benchmark does."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from swarmlab.netlab import unavailable
from tests.conftest import scaled

BENCH = Path(__file__).resolve().parents[3] / "bench" / "overlap.py"


@pytest.mark.slow
@pytest.mark.alone
def test_delays_give_at_least_one_and_a_half_times_the_samples_per_second() -> None:
    reason = unavailable()
    if reason is not None:
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(f"the overlap benchmark is needed in CI: {reason}", pytrace=False)
        pytest.skip(reason)
    # One measured epoch per mode and repetition: the median of three, as one alone ranged
    # 1.49-1.63x over four runs on a two-core machine.
    small = ["--width", "512", "--matchmaking-time", "0.2", "--epochs", "2", "--repeat", "3"]
    done = subprocess.run(
        [sys.executable, str(BENCH), *small, "--check", "--min-ratio", "1.5"],
        capture_output=True,
        text=True,
        timeout=scaled(300),
        stdin=subprocess.DEVNULL,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    rows = dict(re.findall(r"^  (plain|delayed) .*?([\d.]+)\s+\d+\s+[\d.]+$", done.stdout, re.M))
    assert set(rows) == {"plain", "delayed"}, done.stdout
    # the loop waits on averaging less with the delays
    assert float(rows["delayed"]) < float(rows["plain"]), done.stdout
    assert re.search(r"median (\d+\.\d+)x", done.stdout), done.stdout
