"""Fixtures for coordinator tests: every database test runs on SQLite and on PostgreSQL,
each test on a database of its own at the newest migration with only what the migrations
put there. The migrations run once per test process: each test gets a copy of a migrated
SQLite file, or this process's PostgreSQL schema emptied back to that state. Tests of the
migrations themselves take ``empty_database_url``: a new SQLite file or a new schema.

PostgreSQL is found at ``SWARMGRAD_TEST_POSTGRES_URL`` (default: the local server, database
``test``). Without it the PostgreSQL half is skipped — unless ``CI=true``, where its absence
fails the run, so CI can never pass by skipping.
"""

from __future__ import annotations

import atexit
import base64
import contextlib
import functools
import os
import secrets
import shutil
import tempfile
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi import FastAPI
from sqlalchemy import create_engine, text
from sqlalchemy.engine import make_url

from peer.formats.identity import Identity, join_proof_payload
from server.app import create_app
from server.config import Settings

REPO_ROOT = Path(__file__).resolve().parents[2]
POSTGRES_URL = os.environ.get(
    "SWARMGRAD_TEST_POSTGRES_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/test"
)
ADMIN_TOKEN = "test-admin-" + "a" * 40
SECRET_KEY = "test-secret-" + "s" * 40
BACKENDS = ["sqlite", pytest.param("postgresql", marks=pytest.mark.postgres)]


@functools.cache
def _postgres_problem() -> str | None:
    engine = create_engine(POSTGRES_URL, connect_args={"connect_timeout": 3})
    try:
        with engine.connect() as connection:
            connection.execute(text("SELECT 1"))
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    finally:
        engine.dispose()
    return None


def require_postgres() -> None:
    """Skip without PostgreSQL, or fail when ``CI=true``."""
    problem = _postgres_problem()
    if problem is None:
        return
    where = make_url(POSTGRES_URL).render_as_string(hide_password=True)
    message = f"PostgreSQL at {where} is unavailable ({problem})"
    if os.environ.get("CI", "").lower() == "true":
        pytest.fail(message + "; CI=true requires it", pytrace=False)
    pytest.skip(message)


@contextlib.contextmanager
def fresh_database(backend: str, directory: Path) -> Iterator[str]:
    """A URL to an empty database of ``backend``, removed afterwards."""
    if backend == "sqlite":
        yield f"sqlite:///{directory / 'coordinator.db'}"
        return
    require_postgres()
    schema = f"t_{secrets.token_hex(6)}"
    admin = create_engine(POSTGRES_URL)
    with admin.begin() as connection:
        connection.execute(text(f'CREATE SCHEMA "{schema}"'))
    url = make_url(POSTGRES_URL).update_query_dict({"options": f"-csearch_path={schema}"})
    try:
        yield url.render_as_string(hide_password=False)
    finally:
        with admin.begin() as connection:
            connection.execute(text(f'DROP SCHEMA "{schema}" CASCADE'))
        admin.dispose()


@functools.cache
def _sqlite_template() -> Path:
    """A SQLite file migrated to the newest revision, made once per test process."""
    from server.db import upgrade_database

    path = _scratch() / "migrated.db"
    engine = create_engine(f"sqlite:///{path}")
    upgrade_database(engine)
    engine.dispose()  # the last connection's close folds the WAL into the file
    return path


@dataclass(frozen=True)
class _MigratedSchema:
    """This process's PostgreSQL schema at the newest revision, and the rows the migrations
    left in it (seed rows), to empty it back to that state before each test."""

    url: str
    tables: tuple[str, ...]
    seeded: dict[str, list[dict[str, Any]]]


@functools.cache
def _postgres_schema() -> _MigratedSchema:
    from server.db import upgrade_database

    schema = f"t_{secrets.token_hex(6)}"
    admin = create_engine(POSTGRES_URL)
    with admin.begin() as connection:
        connection.execute(text(f'CREATE SCHEMA "{schema}"'))

    def drop() -> None:
        with admin.begin() as connection:
            connection.execute(text(f'DROP SCHEMA "{schema}" CASCADE'))
        admin.dispose()

    atexit.register(drop)
    url = make_url(POSTGRES_URL).update_query_dict({"options": f"-csearch_path={schema}"})
    rendered = url.render_as_string(hide_password=False)
    engine = create_engine(rendered)
    upgrade_database(engine)
    with engine.connect() as connection:
        found = connection.execute(
            text("SELECT tablename FROM pg_tables WHERE schemaname = :s ORDER BY tablename"),
            {"s": schema},
        )
        tables = tuple(t for (t,) in found if t != "alembic_version")
        seeded = {
            table: [
                dict(row._mapping) for row in connection.execute(text(f'SELECT * FROM "{table}"'))
            ]
            for table in tables
        }
    engine.dispose()
    return _MigratedSchema(rendered, tables, {t: rows for t, rows in seeded.items() if rows})


def _emptied(schema: _MigratedSchema) -> str:
    """``schema`` back to its state right after the migrations; its URL."""
    engine = create_engine(schema.url)
    try:
        with engine.begin() as connection:
            # a test that left a transaction open would block this: fail instead of hanging
            connection.execute(text("SET LOCAL lock_timeout = '10s'"))
            names = ", ".join(f'"{t}"' for t in schema.tables)
            connection.execute(text(f"TRUNCATE {names} RESTART IDENTITY CASCADE"))
            for table, rows in schema.seeded.items():
                columns = list(rows[0])
                connection.execute(
                    text(
                        f'INSERT INTO "{table}" ({", ".join(columns)}) '
                        f"VALUES ({', '.join(':' + c for c in columns)})"
                    ),
                    rows,
                )
    finally:
        engine.dispose()
    return schema.url


@contextlib.contextmanager
def migrated_database(backend: str, directory: Path) -> Iterator[str]:
    """A URL to a database of ``backend`` at the newest migration, holding only what the
    migrations put there, without running them again."""
    if backend == "sqlite":
        path = directory / "coordinator.db"
        shutil.copyfile(_sqlite_template(), path)
        yield f"sqlite:///{path}"
        return
    require_postgres()
    yield _emptied(_postgres_schema())


@pytest.fixture(params=BACKENDS)
def database_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    with migrated_database(request.param, tmp_path) as url:
        yield url


@pytest.fixture(params=BACKENDS)
def empty_database_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """A database without tables: for tests of the migrations themselves."""
    with fresh_database(request.param, tmp_path) as url:
        yield url


@functools.cache
def _scratch() -> Path:
    """This test process's directory for what settings need on disk, removed at exit."""
    path = Path(tempfile.mkdtemp(prefix="swarmgrad-test-"))
    atexit.register(shutil.rmtree, path, True)
    return path


def make_settings(database_url: str, **overrides: Any) -> Settings:
    values: dict[str, Any] = {
        "environment": "production",
        "database_url": database_url,
        "secret_key": SECRET_KEY,
        "admin_token": ADMIN_TOKEN,
        "db_pool_size": 4,
        # Exact answers in tests; the cache has its own tests (test_operations.py).
        "peer_auth_cache_ttl_s": 0,
        # Dashboard data as of the request (the cache's own tests: test_document_cache.py).
        "dashboard_cache_s": 0,
        # Tests that cache call app.state.revocation_sweep.sweep_once() when they mean to.
        "peer_auth_recheck_s": 3600,
        # Created only by an upload; tests that upload pass a directory of their own.
        "checkpoint_dir": _scratch() / "checkpoints",
        # One per settings (a restarted app shares it): a test never replays another's.
        "spill_dir": Path(tempfile.mkdtemp(prefix="spill-", dir=_scratch())),
    }
    values.update(overrides)
    return Settings(**values)


@pytest.fixture
def settings(database_url: str, tmp_path: Path) -> Settings:
    return make_settings(database_url, checkpoint_dir=tmp_path / "checkpoints")


@contextlib.asynccontextmanager
async def running(app: FastAPI) -> AsyncIterator[FastAPI]:
    """The app with its lifespan running (migrations applied, report buffer started)."""
    async with app.router.lifespan_context(app):
        yield app


@pytest.fixture
async def app(settings: Settings) -> AsyncIterator[FastAPI]:
    async with running(create_app(settings)) as application:
        yield application


def client_for(app: FastAPI) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://coordinator")


@pytest.fixture
async def client(app: FastAPI) -> AsyncIterator[httpx.AsyncClient]:
    async with client_for(app) as c:
        yield c


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


ORGANIZER = bearer(ADMIN_TOKEN)


def b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).decode("ascii")


def join_proof(run_id: str, challenge: str, identity: Identity) -> dict[str, str]:
    """The fields of a join body that prove ``identity`` holds its key, for a challenge from
    ``POST /api/v1/join/challenge``."""
    signature = identity.sign(join_proof_payload(run_id, challenge, identity.public_key))
    return {
        "public_key": b64(identity.public_key),
        "challenge": challenge,
        "signature": b64(signature),
    }


@dataclass
class JoinedPeer:
    identity: Identity
    body: dict[str, Any]

    @property
    def headers(self) -> dict[str, str]:
        return bearer(self.body["peer_token"])


class Api:
    """Short-hands for the calls most tests make before the one they test."""

    def __init__(self, client: httpx.AsyncClient) -> None:
        self.client = client

    async def create_run(self, name: str = "mnist", **extra: Any) -> dict[str, Any]:
        response = await self.client.post(
            "/api/v1/runs", json={"name": name, "task": "mnist-mlp", **extra}, headers=ORGANIZER
        )
        assert response.status_code == 201, response.text
        return response.json()

    async def create_join_token(self, run_id: str, **body: Any) -> dict[str, Any]:
        response = await self.client.post(
            f"/api/v1/runs/{run_id}/tokens", json=body, headers=ORGANIZER
        )
        assert response.status_code == 201, response.text
        return response.json()

    async def join(
        self,
        run_id: str,
        join_token: str,
        identity: Identity | None = None,
        *,
        addresses: list[str] | None = None,
        client_mode: bool = False,
        display_name: str | None = None,
        expect: int = 200,
    ) -> JoinedPeer:
        """Ask for a challenge and join with its proof. A refused challenge (the run does
        not accept joins, the token is invalid) is returned as the join's answer."""
        identity = identity or Identity()
        challenge = await self.client.post("/api/v1/join/challenge", headers=bearer(join_token))
        if challenge.status_code != 200:
            assert challenge.status_code == expect, challenge.text
            return JoinedPeer(identity, challenge.json())
        body: dict[str, Any] = {
            **join_proof(run_id, challenge.json()["challenge"], identity),
            "addresses": addresses
            if addresses is not None
            else [f"ws://127.0.0.1:{secrets.randbelow(50000) + 10000}"],
            "client_mode": client_mode,
        }
        if display_name is not None:
            body["display_name"] = display_name
        response = await self.client.post(
            f"/api/v1/runs/{run_id}/join", json=body, headers=bearer(join_token)
        )
        assert response.status_code == expect, response.text
        return JoinedPeer(identity, response.json())

    async def report(self, run_id: str, peer: JoinedPeer, **body: Any) -> httpx.Response:
        payload = {"epoch": 0, "samples": 0, "samples_per_second": 0.0, **body}
        return await self.client.post(
            f"/api/v1/runs/{run_id}/reports", json=payload, headers=peer.headers
        )


def reached(app: FastAPI, peer: JoinedPeer, address: str) -> None:
    """Record ``address`` for ``peer`` as the reachability probe does once it reached it:
    only then is it handed to other peers (a join's claimed addresses never are)."""
    from sqlalchemy import update

    from server.models import Peer

    with app.state.session_factory() as session, session.begin():
        session.execute(
            update(Peer)
            .where(Peer.peer_id == peer.body["peer_id"])
            .values(addresses=[address], client_mode=False)
        )


@pytest.fixture
def api(client: httpx.AsyncClient) -> Api:
    return Api(client)


@pytest.fixture
async def run(api: Api) -> dict[str, Any]:
    return await api.create_run(config={"lr": 0.1, "target_batch_size": 4096})


@pytest.fixture
async def join_token(api: Api, run: dict[str, Any]) -> str:
    return (await api.create_join_token(run["id"], label="lab"))["token"]
