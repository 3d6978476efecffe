"""The benchmarks still run end to end (tiny and short; the figures are not checked)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.server.conftest import POSTGRES_URL, REPO_ROOT, require_postgres


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


@pytest.mark.slow
@pytest.mark.postgres
def test_coordinator_volunteers_benchmark_runs() -> None:
    require_postgres()
    result = subprocess.run(
        [
            sys.executable,
            "bench/coordinator_load.py",
            *("--backend", "postgresql", "--postgres-url", POSTGRES_URL),
            *("--volunteers", "6", "--interval", "1", "--duration", "3", "--concurrency", "2"),
        ],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    out = result.stdout
    for line in ("reports ", "bootstrap ", "certificate ", "dashboard ", "report → live"):
        assert line in out, out
    assert "errors 0" in out and "MISMATCH" not in out and "MB per hour" in out


@pytest.mark.slow
def test_redteam_prints_one_line_per_attack_and_fails_on_none_held() -> None:
    def redteam(*pytest_args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "bench/redteam.py", "--", *pytest_args],
            cwd=REPO_ROOT,
            capture_output=True,
            text=True,
            timeout=300,
        )

    held = redteam("-k", "test_subkeys or open_node_beyond_loopback")
    assert held.returncode == 0, held.stdout + held.stderr
    rows = [line for line in held.stdout.splitlines() if "  held  " in line]
    assert len(rows) >= 2 and "0 got through" in held.stdout
    # no attack selected: the bench says so and fails instead of passing on nothing
    nothing = redteam("-k", "no_attack_has_this_name")
    assert nothing.returncode != 0 and "no attack ran" in nothing.stderr
