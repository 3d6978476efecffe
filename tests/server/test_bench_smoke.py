"""The benchmarks still run end to end (tiny and short; the figures are not checked)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.server.conftest import REPO_ROOT


@pytest.mark.slow
def test_coordinator_load_benchmark_runs() -> None:
    result = subprocess.run(
        [
            sys.executable,
            "bench/coordinator_load.py",
            "--backend",
            "sqlite",
            "--peers",
            "4",
            "--duration",
            "1",
            "--concurrency",
            "2",
        ],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert "reports :" in result.stdout and "errors 0" in result.stdout
    assert "MISMATCH" not in result.stdout


@pytest.mark.slow
def test_dashboard_benchmark_runs() -> None:
    result = subprocess.run(
        [
            sys.executable,
            "bench/dashboard.py",
            *("--peers", "20", "--sizes", "500,1000", "--requests", "5", "--live-reports", "2"),
        ],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert "p50/healthz" in result.stdout and "report → live page" in result.stdout
