"""Upgrade → downgrade → upgrade on both databases, and the models match the
migrations (autogenerate finds nothing to add); data migrations do what they say."""

from __future__ import annotations

import subprocess
import sys
from datetime import UTC, datetime, timedelta

import pytest
from alembic import command
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from sqlalchemy import column, create_engine, insert, inspect, select, table

from server.db import alembic_config
from server.models import Base
from tests.server.conftest import REPO_ROOT


@pytest.fixture
def database_url(empty_database_url: str) -> str:
    """These tests run the migrations themselves, from a database without tables."""
    return empty_database_url


TABLES = {
    "runs",
    "tokens",
    "volunteers",
    "peers",
    "progress_reports",
    "epoch_summaries",
    "progress_snapshots",
    "checkpoints",
    "checkpoint_proposals",
    "spilled_segments",
    "task_files",
    "report_rollups",
    "housekeeping",
}


def _tables(url: str) -> set[str]:
    engine = create_engine(url)
    try:
        return set(inspect(engine).get_table_names()) - {"alembic_version"}
    finally:
        engine.dispose()


def test_upgrade_downgrade_upgrade(database_url: str) -> None:
    config = alembic_config(database_url)
    command.upgrade(config, "head")
    assert _tables(database_url) == TABLES
    command.downgrade(config, "base")
    assert _tables(database_url) == set()
    command.upgrade(config, "head")
    assert _tables(database_url) == TABLES


def test_models_match_migrations(database_url: str) -> None:
    command.upgrade(alembic_config(database_url), "head")
    engine = create_engine(database_url)
    try:
        with engine.connect() as connection:
            context = MigrationContext.configure(connection, opts={"compare_type": True})
            diff = compare_metadata(context, Base.metadata)
    finally:
        engine.dispose()
    assert diff == []


def test_alembic_command_line(database_url: str) -> None:
    """What an organizer runs by hand: ``alembic upgrade head`` with the URL in the env."""
    env = {"SWARMGRAD_DATABASE_URL": database_url, "PATH": ""}
    for args in (["upgrade", "head"], ["downgrade", "base"], ["upgrade", "head"], ["check"]):
        result = subprocess.run(
            [sys.executable, "-m", "alembic", "-c", str(REPO_ROOT / "alembic.ini"), *args],
            cwd=REPO_ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert result.returncode == 0, (args, result.stderr)
    assert _tables(database_url) == TABLES


def test_peer_tokens_from_before_expiry_get_one(database_url: str) -> None:
    config = alembic_config(database_url)
    command.upgrade(config, "0004")
    engine = create_engine(database_url)
    tokens = Base.metadata.tables["tokens"]
    now = datetime.now(UTC)
    row = {
        "secret_hash": b"h" * 32,
        "created_at": now,
        "uses": 0,
        "expires_at": None,
        "revoked_at": None,
    }
    try:
        with engine.begin() as connection:
            connection.execute(
                insert(tokens),
                [
                    {**row, "id": "p" * 16, "scope": "peer"},
                    {**row, "id": "r" * 16, "scope": "peer", "revoked_at": now},
                    {**row, "id": "o" * 16, "scope": "organizer"},
                ],
            )
        command.upgrade(config, "head")
        with engine.connect() as connection:
            expiry = dict(connection.execute(select(tokens.c.id, tokens.c.expires_at)).all())
    finally:
        engine.dispose()
    assert expiry["r" * 16] is None and expiry["o" * 16] is None
    assert now + timedelta(days=13) < expiry["p" * 16] < now + timedelta(days=15)


def test_display_name_keys_are_filled_in_for_existing_volunteers(database_url: str) -> None:
    from server.services.display_names import comparison_key

    config = alembic_config(database_url)
    command.upgrade(config, "0010")
    engine = create_engine(database_url)
    runs = Base.metadata.tables["runs"]
    columns = ("id", "run_id", "display_name", "join_token_id", "created_at")
    volunteers = table("volunteers", *(column(name) for name in columns))
    now = datetime.now(UTC)
    names = ["honest", "hon\u200best", "José", "anonymous volunteer"]
    try:
        with engine.begin() as connection:
            connection.execute(
                insert(runs),
                {
                    "id": "r" * 16,
                    "name": "run",
                    "task": "digits",
                    "config": {},
                    "status": "running",
                    "created_at": now,
                    "updated_at": now,
                    "authority_public_key": b"k" * 32,
                    "authority_private_key_encrypted": b"s" * 64,
                    "last_snapshot_ms": 0,
                },
            )
            connection.execute(
                insert(volunteers),
                [
                    {"id": i, "run_id": "r" * 16, "display_name": name, "created_at": now}
                    for i, name in enumerate(names, start=1)
                ],
            )
        command.upgrade(config, "head")
        keys = Base.metadata.tables["volunteers"]
        with engine.connect() as connection:
            stored = dict(connection.execute(select(keys.c.display_name, keys.c.name_key)).all())
    finally:
        engine.dispose()
    assert stored == {name: comparison_key(name) for name in names}
    # A name stored before invisible characters were refused collides with its visible form.
    assert stored["hon\u200best"] == stored["honest"]


def test_runs_stored_before_they_could_wait_neither_wait_nor_ended_by_themselves(
    database_url: str,
) -> None:
    config = alembic_config(database_url)
    command.upgrade(config, "0011")
    engine = create_engine(database_url)
    columns = ("id", "name", "task", "config", "status", "created_at", "updated_at")
    keys = ("authority_public_key", "authority_private_key_encrypted", "last_snapshot_ms")
    before = table("runs", *(column(name) for name in (*columns, *keys)))
    now = datetime.now(UTC)
    row = {
        "name": "run",
        "task": "digits",
        "config": '{"epochs": 3}',
        "created_at": now,
        "updated_at": now,
        "authority_public_key": b"k" * 32,
        "authority_private_key_encrypted": b"s" * 64,
        "last_snapshot_ms": 0,
    }
    try:
        with engine.begin() as connection:
            connection.execute(
                insert(before),
                [
                    {**row, "id": "p" * 16, "status": "paused"},
                    {**row, "id": "f" * 16, "status": "finished"},
                ],
            )
        command.upgrade(config, "head")
        runs = Base.metadata.tables["runs"]
        with engine.connect() as connection:
            stored = connection.execute(
                select(runs.c.id, runs.c.status, runs.c.min_volunteers, runs.c.finished_at_epoch)
            ).all()
    finally:
        engine.dispose()
    assert sorted(tuple(r) for r in stored) == [
        ("f" * 16, "finished", None, None),
        ("p" * 16, "paused", None, None),
    ]
