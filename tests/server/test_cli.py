"""`swarmgrad coordinator` and `swarmgrad coordinator admin-token`, including a real uvicorn
process that is stopped with SIGTERM while it holds acknowledged, unwritten reports."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from sqlalchemy import create_engine, func, select
from typer.testing import CliRunner

from peer.formats.identity import Identity
from server.app import create_app
from server.cli import app as cli
from server.models import ProgressReport
from tests.server.conftest import (
    SECRET_KEY,
    bearer,
    client_for,
    join_proof,
    make_settings,
    running,
)

STARTUP_DEADLINE_S = 30.0


def _env(database_url: str, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SWARMGRAD_")}
    env.update(
        SWARMGRAD_ENVIRONMENT="production",
        SWARMGRAD_SECRET_KEY=SECRET_KEY,
        SWARMGRAD_DATABASE_URL=database_url,
        **extra,
    )
    return env


async def test_admin_token_is_printed_and_works(
    database_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    for key, value in _env(database_url).items():
        monkeypatch.setenv(key, value)
    result = CliRunner().invoke(cli, ["admin-token", "--label", "ops"])
    assert result.exit_code == 0, result.output
    token = result.stdout.strip().splitlines()[-1]
    assert token.startswith("sgo_")
    settings = make_settings(database_url, admin_token=None)
    async with running(create_app(settings)) as app, client_for(app) as client:
        body = {"name": "n", "task": "t"}
        assert (
            await client.post("/api/v1/runs", json=body, headers=bearer(token))
        ).status_code == 201
        wrong = await client.post("/api/v1/runs", json=body, headers=bearer(token[:-1] + "?"))
        assert wrong.status_code == 401


def test_production_without_a_secret_refuses_to_start(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("SWARMGRAD_SECRET_KEY", raising=False)
    monkeypatch.setenv("SWARMGRAD_ENVIRONMENT", "production")
    result = CliRunner().invoke(cli, ["--database-url", f"sqlite:///{tmp_path / 'x.db'}"])
    assert result.exit_code == 2
    assert "SWARMGRAD_SECRET_KEY" in result.stderr and "refusing to start" in result.stderr
    assert not (tmp_path / "x.db").exists()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def coordinator(database_url: str, tmp_path: Path) -> Iterator[tuple[str, subprocess.Popen[str]]]:
    port = _free_port()
    process = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "from server.cli import app; app()",
            "--port",
            str(port),
            "--log-level",
            "warning",
        ],
        env=_env(database_url, SWARMGRAD_REPORT_FLUSH_INTERVAL_S="3600"),
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + STARTUP_DEADLINE_S
    while True:  # readiness poll: the process tells us nothing else when it is listening
        if process.poll() is not None:
            with process.stdout:  # type: ignore[union-attr]
                pytest.fail(
                    f"coordinator exited early ({process.returncode}):\n{process.stdout.read()}"
                )  # type: ignore[union-attr]
        try:
            if httpx.get(f"{base}/healthz", timeout=1).status_code == 200:
                break
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline:
            process.kill()
            pytest.fail("coordinator did not become ready")
        time.sleep(0.05)
    try:
        yield base, process
    finally:
        if process.poll() is None:
            process.kill()
        process.wait(timeout=10)
        process.stdout.close()  # type: ignore[union-attr]


def test_sigterm_flushes_acknowledged_reports(
    coordinator: tuple[str, subprocess.Popen[str]],
    database_url: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    base, process = coordinator
    for key, value in _env(database_url).items():
        monkeypatch.setenv(key, value)
    organizer = CliRunner().invoke(cli, ["admin-token"]).stdout.strip().splitlines()[-1]
    with httpx.Client(base_url=f"{base}/api/v1", timeout=10) as http:
        run = http.post("/runs", json={"name": "n", "task": "t"}, headers=bearer(organizer)).json()
        invite = http.post(f"/runs/{run['id']}/tokens", json={}, headers=bearer(organizer)).json()
        challenge = http.post("/join/challenge", headers=bearer(invite["token"])).json()
        joined = http.post(
            f"/runs/{run['id']}/join",
            json={
                **join_proof(run["id"], challenge["challenge"], Identity()),
                "addresses": ["ws://127.0.0.1:9"],
            },
            headers=bearer(invite["token"]),
        ).json()
        for samples in range(1, 51):
            response = http.post(
                f"/runs/{run['id']}/reports",
                json={"epoch": 0, "samples": samples, "samples_per_second": 1.0},
                headers=bearer(joined["peer_token"]),
            )
            assert response.status_code == 202
        metrics = httpx.get(f"{base}/metrics").text
        assert "swarmgrad_process_report_buffer_pending" in metrics
    process.send_signal(signal.SIGTERM)
    # uvicorn shuts down gracefully, then re-raises the signal so the exit status tells
    # a supervisor what stopped it.
    assert process.wait(timeout=30) in (0, -signal.SIGTERM)
    output = process.stdout.read()  # type: ignore[union-attr]
    assert "Traceback" not in output and "dropping" not in output
    engine = create_engine(database_url)
    try:
        with engine.connect() as connection:
            assert connection.scalar(select(func.count()).select_from(ProgressReport)) == 50
    finally:
        engine.dispose()
