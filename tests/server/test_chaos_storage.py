"""Chaos: the coordinator's database loses its storage while volunteers keep reporting.

SQLite on a filesystem of its own (a size-limited tmpfs) that fills up, then turns
read-only; PostgreSQL refusing every connection for a while. In each: calls that need to
write get 503 with Retry-After and a JSON detail, reads are answered where they can be, the
log says what is wrong, and once storage returns every report acknowledged with 202 is in the
database and the database is intact.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import gc
import logging
import re
import secrets
import subprocess
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi import FastAPI
from sqlalchemy import create_engine, func, select, text
from sqlalchemy.engine import make_url

from server.app import create_app
from server.models import Peer, ProgressReport
from swarmlab.node_process import wait_until, wait_until_async
from tests.conftest import scaled
from tests.server.conftest import (
    ORGANIZER,
    POSTGRES_URL,
    Api,
    JoinedPeer,
    client_for,
    make_settings,
    require_postgres,
    running,
)


def _mount(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["mount", *args], capture_output=True, text=True, check=False)


@contextlib.contextmanager
def small_filesystem(path: Path, size: str = "4m") -> Iterator[Path]:
    """A tmpfs of ``size`` mounted on ``path`` (needs root), unmounted afterwards."""
    path.mkdir(parents=True, exist_ok=True)
    done = _mount("-t", "tmpfs", "-o", f"size={size},mode=0700", "tmpfs", str(path))
    if done.returncode != 0:
        pytest.fail(
            f"this scenario needs its own small filesystem and could not mount a tmpfs on "
            f"{path} (run the tests as root): {done.stderr.strip()}",
            pytrace=False,
        )
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


def fill(directory: Path) -> None:
    """Write a file into ``directory`` until its filesystem has no space left."""
    with open(directory / "filler", "wb", buffering=0) as file:  # nothing left to flush
        try:
            while True:
                file.write(b"\0" * 65536)
        except OSError as error:
            assert error.errno == errno.ENOSPC, error


async def remount_read_only(
    app: FastAPI, directory: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Remount ``directory``'s filesystem read-only: possible only once no file on it is
    open for writing, so the pool's connections are closed first (and again if the flusher
    opened one meanwhile). The log records captured so far go first: their arguments are
    the database's errors, whose tracebacks hold the connections that raised them (a
    process that logs does not keep its records)."""

    def attempt() -> bool:
        caplog.clear()
        gc.collect()
        app.state.engine.dispose()
        return _mount("-o", "remount,ro", str(directory)).returncode == 0

    # polled while the loop runs, so that a flush in flight completes between attempts (a
    # blocked loop keeps its result, and what that holds, alive)
    assert await wait_until_async(attempt, scaled(30)), (
        f"the filesystem stayed busy; open on it here: {_open_files(directory)}"
    )


def _open_files(directory: Path) -> list[str]:
    """This process's descriptors on files under ``directory``, with their open flags (what
    keeps a remount read-only from happening)."""
    found = []
    for fd in Path("/proc/self/fd").iterdir():
        with contextlib.suppress(OSError):
            target = fd.readlink()
            if str(target).startswith(str(directory)):
                flags = (Path("/proc/self/fdinfo") / fd.name).read_text().split("\n")[1]
                found.append(f"{target} ({flags.strip()})")
    return found


def restore(directory: Path) -> None:
    """Make ``directory``'s filesystem writable again, with its space back."""
    assert _mount("-o", "remount,rw", str(directory)).returncode == 0
    (directory / "filler").unlink()


def stored(app: FastAPI) -> int:
    with app.state.session_factory() as session:
        return int(session.scalar(select(func.count()).select_from(ProgressReport)) or 0)


def assert_unavailable(response: httpx.Response) -> None:
    assert response.status_code == 503, response.text
    assert re.fullmatch(r"[1-9][0-9]*", response.headers["Retry-After"])
    assert isinstance(response.json()["detail"], str)


class Swarm:
    """Two volunteers reporting through one client; counts what was acknowledged."""

    def __init__(self, api: Api, run_id: str, peers: list[JoinedPeer]) -> None:
        self.api, self.run_id, self.peers = api, run_id, peers
        self.samples = [0] * len(peers)
        self.acknowledged = 0

    async def report(self, rounds: int) -> None:
        for _ in range(rounds):
            for i, peer in enumerate(self.peers):
                self.samples[i] += 32
                response = await self.api.report(self.run_id, peer, samples=self.samples[i])
                assert response.status_code == 202, response.text
                self.acknowledged += 1

    async def writes_refused(self) -> None:
        """An organizer's writes and a new volunteer's join: 503."""
        client = self.api.client
        assert_unavailable(
            await client.post("/api/v1/runs", json={"name": "x", "task": "t"}, headers=ORGANIZER)
        )
        assert_unavailable(
            await client.post(f"/api/v1/runs/{self.run_id}/tokens", json={}, headers=ORGANIZER)
        )

    async def reads_answered(self) -> None:
        client = self.api.client
        for path in ("/api/v1/runs", f"/api/v1/runs/{self.run_id}/peers"):
            response = await client.get(path, headers=ORGANIZER)
            assert response.status_code == 200, (path, response.text)

    def assert_all_stored(self, app: FastAPI) -> None:
        with app.state.session_factory() as session:
            assert session.scalar(select(func.count()).select_from(ProgressReport)) == (
                self.acknowledged
            )
            counters = dict(session.execute(select(Peer.peer_id, Peer.samples)).all())
        assert [counters[p.body["peer_id"]] for p in self.peers] == self.samples


@contextlib.asynccontextmanager
async def reporting(
    caplog: pytest.LogCaptureFixture, url: str, **overrides: Any
) -> AsyncIterator[tuple[FastAPI, Swarm]]:
    """A coordinator on ``url`` with two volunteers that have reported once (their tokens
    are cached: reports need no database to be acknowledged). Errors are logged, none of
    them an unhandled one (a 500)."""
    caplog.set_level(logging.ERROR)
    settings = make_settings(url, peer_auth_cache_ttl_s=3600, **overrides)
    async with running(create_app(settings)) as app, client_for(app) as client:
        api = Api(client)
        run = await api.create_run()
        invite = (await api.create_join_token(run["id"]))["token"]
        swarm = Swarm(api, run["id"], [await api.join(run["id"], invite) for _ in range(2)])
        await swarm.report(1)
        await app.state.report_buffer.flush()
        yield app, swarm
    assert "unhandled error" not in caplog.text


async def wait_stored(app: FastAPI, n: int) -> None:
    assert await asyncio.to_thread(wait_until, lambda: stored(app) == n, scaled(20)), (
        f"{stored(app)} of {n} acknowledged reports stored"
    )


async def test_sqlite_on_a_full_then_read_only_filesystem(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with small_filesystem(tmp_path / "db") as disk:
        url = f"sqlite:///{disk / 'coordinator.db'}"
        # The spill on another filesystem: it survives this.
        async with reporting(caplog, url, spill_dir=tmp_path / "spill") as (app, swarm):
            fill(disk)
            await swarm.report(5)
            await swarm.writes_refused()
            await swarm.reads_answered()
            assert "database or disk is full" in caplog.text

            await remount_read_only(app, disk, caplog)
            await swarm.report(5)
            await swarm.writes_refused()
            await swarm.reads_answered()
            assert "readonly database" in caplog.text
            assert stored(app) == 2  # the rest is spilled

            restore(disk)
            await wait_stored(app, swarm.acknowledged)
            swarm.assert_all_stored(app)
            created = await swarm.api.client.post(
                "/api/v1/runs", json={"name": "again", "task": "t"}, headers=ORGANIZER
            )
            assert created.status_code == 201, created.text
            with app.state.engine.connect() as connection:
                assert connection.execute(text("PRAGMA integrity_check")).scalar() == "ok"


async def test_a_spill_on_the_same_full_disk_keeps_reports_in_memory_then_refuses(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with small_filesystem(tmp_path / "disk") as disk:
        url = f"sqlite:///{disk / 'coordinator.db'}"
        # At most 8 reports held in memory.
        spill = {"spill_dir": disk / "spill", "report_buffer_max": 4}
        async with reporting(caplog, url, **spill) as (app, swarm):
            fill(disk)
            await swarm.report(3)
            await app.state.report_buffer.flush()
            spill_errors = [r for r in caplog.records if "cannot spill" in r.getMessage()]
            assert len(spill_errors) == 1, caplog.text  # said once, not at every flush
            assert "SWARMGRAD_SPILL_DIR" in spill_errors[0].getMessage()
            # Memory is bounded: past it, reports are refused rather than acknowledged.
            refused = 0
            for samples in range(10_000, 10_040):
                response = await swarm.api.report(swarm.run_id, swarm.peers[0], samples=samples)
                if response.status_code == 202:
                    swarm.acknowledged += 1
                    swarm.samples[0] = samples
                else:
                    assert_unavailable(response)
                    refused += 1
            assert refused > 0 and app.state.report_buffer.pending <= 8

            (disk / "filler").unlink()
            await wait_stored(app, swarm.acknowledged)
            swarm.assert_all_stored(app)


@contextlib.contextmanager
def separate_postgres_database() -> Iterator[tuple[str, Any]]:
    """A PostgreSQL database of this test's own (so that cutting it off disturbs no other
    test), and an engine on the server's maintenance connection; dropped afterwards."""
    require_postgres()
    name = f"chaos_{secrets.token_hex(6)}"
    admin = create_engine(POSTGRES_URL, isolation_level="AUTOCOMMIT")
    with admin.connect() as connection:
        connection.execute(text(f'CREATE DATABASE "{name}"'))
    try:
        yield make_url(POSTGRES_URL).set(database=name).render_as_string(False), admin
    finally:
        with admin.connect() as connection:
            connection.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()


def cut_off(admin: Any, database: str, allow: bool) -> None:
    """Refuse (or allow again) connections to ``database``, ending those it has."""
    with admin.connect() as connection:
        connection.execute(text(f'ALTER DATABASE "{database}" ALLOW_CONNECTIONS {allow}'))
        if not allow:
            connection.execute(
                text(
                    "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                    "WHERE datname = :name AND pid <> pg_backend_pid()"
                ),
                {"name": database},
            )


@pytest.mark.postgres
async def test_postgresql_stopping_for_a_while(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with separate_postgres_database() as (url, admin):
        database = make_url(url).database
        assert database is not None
        async with reporting(caplog, url, spill_dir=tmp_path / "spill") as (app, swarm):
            cut_off(admin, database, allow=False)
            try:
                await swarm.report(5)
                await swarm.writes_refused()
                # Nothing can be read either: 503 as well, not 500.
                assert_unavailable(await swarm.api.client.get("/api/v1/runs", headers=ORGANIZER))
                assert "database unavailable" in caplog.text
                await app.state.report_buffer.flush()
                assert list((tmp_path / "spill").glob("*.jsonl"))  # spilled, on disk
            finally:
                cut_off(admin, database, allow=True)
            await wait_stored(app, swarm.acknowledged)
            swarm.assert_all_stored(app)
