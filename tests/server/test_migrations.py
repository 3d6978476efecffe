"""Point 2: upgrade → downgrade → upgrade on both databases, and the models match the
migrations (autogenerate finds nothing to add); data migrations do what they say."""

from __future__ import annotations

import subprocess
import sys
from datetime import UTC, datetime, timedelta

from alembic import command
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from sqlalchemy import create_engine, insert, inspect, select

from server.db import alembic_config
from server.models import Base
from tests.server.conftest import REPO_ROOT

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
