"""Fixtures for the command line's tests: a real coordinator (``server.app.create_app`` served
by uvicorn in a background thread on a free port), a plain HTTP server that is not a
coordinator, and runners for ``swarmgrad`` in this process or in a child process."""

from __future__ import annotations

import contextlib
import http.server
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import scaled, served

ADMIN_TOKEN = "cli-admin-" + "a" * 40
SECRET_KEY = "cli-secret-" + "s" * 40


@dataclass
class Coordinator:
    url: str
    admin_token: str
    database_url: str

    def client(self) -> Any:
        from peer.coordinator import CoordinatorClient

        return CoordinatorClient(self.url)


@contextlib.contextmanager
def serve_coordinator(directory: Path) -> Iterator[Coordinator]:
    """A coordinator on SQLite in ``directory``, like tests/server/conftest.py's settings."""
    from server.app import create_app
    from server.config import Settings

    database_url = f"sqlite:///{directory / 'coordinator.db'}"
    settings = Settings(
        environment="production",
        database_url=database_url,
        secret_key=SECRET_KEY,
        admin_token=ADMIN_TOKEN,
        db_pool_size=4,
        peer_auth_cache_ttl_s=0,
        report_flush_interval_s=0,
        checkpoint_dir=directory / "checkpoints",
    )
    with served(create_app(settings)) as url:
        yield Coordinator(url, ADMIN_TOKEN, database_url)


@pytest.fixture
def coordinator(tmp_path: Path) -> Iterator[Coordinator]:
    with serve_coordinator(tmp_path) as running:
        yield running


class _NotACoordinator(http.server.BaseHTTPRequestHandler):
    def _answer(self) -> None:
        body = b'{"hello": "I am some other web server"}'
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    do_GET = do_POST = do_PUT = do_PATCH = _answer

    def log_message(self, format: str, *args: Any) -> None:
        pass


@pytest.fixture
def other_server() -> Iterator[str]:
    """The URL of a plain HTTP server that answers 200 to everything: not a coordinator."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _NotACoordinator)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


@dataclass
class Result:
    code: int
    out: str
    err: str

    def assert_one_error_line(self, *, code: int | None = None) -> str:
        """The failure discipline: non-zero status, exactly one stderr line ``error: ...``,
        no traceback anywhere. Returns that line."""
        assert self.code != 0, (self.code, self.out, self.err)
        if code is not None:
            assert self.code == code, (self.code, self.out, self.err)
        lines = self.err.splitlines()
        assert len(lines) == 1, self.err
        assert lines[0].startswith("error: "), self.err
        assert "Traceback" not in self.out + self.err
        return lines[0]


@pytest.fixture
def cli(capsys: pytest.CaptureFixture[str]) -> Any:
    """``cli(*args)`` runs ``swarmgrad *args`` in this process; a :class:`Result`."""
    from swarmgrad.cli import main

    def run(*args: str) -> Result:
        capsys.readouterr()
        with pytest.raises(SystemExit) as exited:
            main(list(args))
        captured = capsys.readouterr()
        code = exited.value.code
        return Result(code if isinstance(code, int) else 1, captured.out, captured.err)

    return run


def child_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SWARMGRAD_")}
    env.update(extra)
    return env


def run_swarmgrad(*args: str, timeout: float = 120, env: dict[str, str] | None = None) -> Result:
    """``python -m swarmgrad *args`` in a child process; a :class:`Result`."""
    done = subprocess.run(
        [sys.executable, "-m", "swarmgrad", *args],
        capture_output=True,
        text=True,
        timeout=scaled(timeout),
        stdin=subprocess.DEVNULL,
        env=env if env is not None else child_env(),
    )
    return Result(done.returncode, done.stdout, done.stderr)
