"""Without PostgreSQL the PostgreSQL half of the suite is skipped locally but fails under
``CI=true`` (so CI cannot go green by skipping)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

from tests.server.conftest import REPO_ROOT


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_healthz_test(ci: str | None) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ)
    env.pop("CI", None)
    if ci is not None:
        env["CI"] = ci
    env["SWARMGRAD_TEST_POSTGRES_URL"] = (
        f"postgresql+psycopg://postgres@127.0.0.1:{_closed_port()}/nothing"
    )
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-p",
            "no:cacheprovider",
            "-q",
            "tests/server/test_runs.py::test_healthz",
        ],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_missing_postgres_is_skipped_locally() -> None:
    result = _run_healthz_test(ci=None)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "1 passed, 1 skipped" in result.stdout


def test_missing_postgres_fails_under_ci() -> None:
    result = _run_healthz_test(ci="true")
    assert result.returncode != 0
    assert "CI=true requires it" in result.stdout
    assert "1 passed" in result.stdout  # the SQLite half still ran
