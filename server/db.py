"""Engine, sessions and schema migrations.

The engine is built from :class:`~server.config.Settings` by the app factory; there is no
module-level engine. SQLite gets write-ahead logging and ``synchronous=NORMAL`` (durable
across application crashes, may lose the last transactions on power loss) and a busy
timeout so that several worker processes can share one file.
"""

from __future__ import annotations

import contextlib
import os
import sqlite3
import zlib
from collections.abc import Iterator
from pathlib import Path

from alembic.config import Config
from sqlalchemy import Engine, create_engine, event, text
from sqlalchemy.orm import Session, sessionmaker
from sqlalchemy.pool import ConnectionPoolEntry

from server.config import Settings


def _migrations_dir() -> Path:
    """The Alembic scripts: installed, the data package ``server.migrations`` (the wheel maps
    the repository's top-level ``migrations/`` there, see [tool.setuptools.package-dir]); in
    the repository: ``migrations/`` beside ``server/``."""
    installed = Path(__file__).resolve().parent / "migrations"
    if (installed / "env.py").is_file():
        return installed
    return Path(__file__).resolve().parents[1] / "migrations"


MIGRATIONS_DIR = _migrations_dir()

# Any constant works; it only has to be the same in every worker.
_MIGRATION_LOCK_ID = zlib.crc32(b"swarmgrad-migrations")


def make_engine(settings: Settings) -> Engine:
    """A connection pool for ``settings.database_url``."""
    url = settings.database_url
    if url.startswith("sqlite"):
        engine = create_engine(
            url,
            connect_args={"check_same_thread": False, "timeout": 30},
            pool_size=settings.db_pool_size,
            max_overflow=2 * settings.db_pool_size,
        )
        event.listen(engine, "connect", _sqlite_on_connect)
        event.listen(engine, "connect", _sqlite_mark_read_only)
        event.listen(engine, "checkin", _sqlite_close_read_only)
        return engine
    return create_engine(
        url,
        pool_size=settings.db_pool_size,
        max_overflow=2 * settings.db_pool_size,
        pool_pre_ping=True,
    )


def _sqlite_on_connect(dbapi_connection: sqlite3.Connection, _record: ConnectionPoolEntry) -> None:
    cursor = dbapi_connection.cursor()
    cursor.execute("PRAGMA journal_mode=WAL")
    cursor.execute("PRAGMA synchronous=NORMAL")
    cursor.execute("PRAGMA foreign_keys=ON")
    cursor.execute("PRAGMA busy_timeout=30000")
    cursor.close()


def _sqlite_mark_read_only(
    dbapi_connection: sqlite3.Connection, record: ConnectionPoolEntry
) -> None:
    # SQLite opens a file it cannot write read-only, silently, and such a connection stays
    # read-only — as does every connection the process opens to that file while one of them
    # holds it (they share its WAL index). So a connection opened on a read-only filesystem
    # serves the reads it was opened for and is closed when it comes back to the pool: the
    # first one opened after the filesystem is writable again writes.
    cursor = dbapi_connection.cursor()
    path = next((row[2] for row in cursor.execute("PRAGMA database_list") if row[1] == "main"), "")
    cursor.close()
    if path and not os.access(os.path.dirname(path) or ".", os.W_OK):
        record.info["read_only"] = True


def _sqlite_close_read_only(
    _dbapi_connection: sqlite3.Connection, record: ConnectionPoolEntry
) -> None:
    if record.info.get("read_only"):
        record.invalidate()


def make_session_factory(engine: Engine) -> sessionmaker[Session]:
    return sessionmaker(engine, expire_on_commit=False)


def alembic_config(url: str | None = None) -> Config:
    """An Alembic config for the package's migrations, built without an ini file;
    ``url`` overrides ``SWARMGRAD_DATABASE_URL``."""
    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS_DIR))
    if url is not None:
        # ConfigParser interpolation treats '%' specially (URL-encoded options contain it).
        config.set_main_option("sqlalchemy.url", url.replace("%", "%%"))
    return config


def upgrade_database(engine: Engine) -> None:
    """Bring the schema to the newest migration.

    Safe to call from several workers at once on PostgreSQL (an advisory lock serialises
    them; the later ones find the schema current). On SQLite the CLI migrates once in the
    parent process before it starts workers.
    """
    from alembic import command

    with engine.connect() as connection:
        if connection.dialect.name == "postgresql":
            connection.execute(text("SELECT pg_advisory_lock(:id)"), {"id": _MIGRATION_LOCK_ID})
            connection.commit()
        try:
            config = alembic_config(engine.url.render_as_string(hide_password=False))
            config.attributes["connection"] = connection
            command.upgrade(config, "head")
            connection.commit()
        finally:
            if connection.dialect.name == "postgresql":
                connection.execute(
                    text("SELECT pg_advisory_unlock(:id)"), {"id": _MIGRATION_LOCK_ID}
                )
                connection.commit()


@contextlib.contextmanager
def session_scope(factory: sessionmaker[Session]) -> Iterator[Session]:
    """A session committed on success and rolled back on error."""
    with factory() as session:
        try:
            yield session
            session.commit()
        except BaseException:
            session.rollback()
            raise
