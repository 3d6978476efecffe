"""bench/wan.py still runs end to end: tiny and short, the figures are not checked.

Needs root and iproute2 (the emulated links); skipped elsewhere with the reason, and a failure
under ``CI=true``.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from swarmlab.netlab import unavailable
from tests.conftest import scaled

REPO_ROOT = Path(__file__).resolve().parents[2]
REASON = unavailable()
if REASON is not None:
    if os.environ.get("CI", "").lower() == "true":
        pytest.fail(f"the network lab is needed in CI: {REASON}", pytrace=False)
    pytest.skip(REASON, allow_module_level=True)


@pytest.mark.slow
def test_the_wan_benchmark_runs_every_method_and_draws_its_plot(tmp_path: Path) -> None:
    plot = tmp_path / "wan.png"
    result = subprocess.run(
        [
            *(sys.executable, "bench/wan.py", "--peers", "2", "--rate", "50", "--rtt", "20"),
            *("--samples", "64", "--batch", "8", "--target", "32", "--inner-steps", "4"),
            *("--fragments", "2", "--d-model", "16", "--layers", "1", "--snapshots", "2"),
            *("--eval-windows", "8", "--plot", str(plot)),
        ],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=scaled(300),
    )
    assert result.returncode == 0, result.stderr[-3000:]
    out = result.stdout
    for method in ("optimizer", "optimizer+delay", "diloco", "streaming"):
        assert f"\n  {method} " in out, out
    assert out.count("goal: ") == 3, out
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bad_arguments_are_one_line() -> None:
    result = subprocess.run(
        [sys.executable, "bench/wan.py", "--samples", "100"],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=scaled(60),
    )
    assert result.returncode != 0
    assert "--samples must be a multiple" in result.stderr
    assert "Traceback" not in result.stderr
