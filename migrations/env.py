"""Alembic environment for the coordinator.

The URL is, in order: a connection handed over by the caller
(``config.attributes["connection"]``, used by ``server.db.upgrade_database``), the
``sqlalchemy.url`` option, or ``SWARMGRAD_DATABASE_URL`` (default: the SQLite file the
server uses by default). Logging is configured only when run from the ``alembic`` command,
so that applying migrations at server start leaves the server's logging alone.
"""

from __future__ import annotations

import os
from logging.config import fileConfig

from alembic import context
from sqlalchemy import Connection, create_engine, pool

from server.models import Base

config = context.config
target_metadata = Base.metadata


def _url() -> str:
    return (
        config.get_main_option("sqlalchemy.url")
        or os.environ.get("SWARMGRAD_DATABASE_URL")
        or "sqlite:///./swarmgrad.db"
    )


def _configure_and_run(connection: Connection) -> None:
    context.configure(
        connection=connection,
        target_metadata=target_metadata,
        render_as_batch=connection.dialect.name == "sqlite",
        compare_type=True,
    )
    with context.begin_transaction():
        context.run_migrations()


def run_migrations_offline() -> None:
    context.configure(
        url=_url(), target_metadata=target_metadata, literal_binds=True, render_as_batch=True
    )
    with context.begin_transaction():
        context.run_migrations()


def run_migrations_online() -> None:
    connection = config.attributes.get("connection")
    if connection is not None:
        _configure_and_run(connection)
        return
    if config.config_file_name is not None and config.attributes.get("configure_logger", True):
        fileConfig(config.config_file_name, disable_existing_loggers=False)
    engine = create_engine(_url(), poolclass=pool.NullPool)
    with engine.connect() as connection:
        _configure_and_run(connection)
    engine.dispose()


if context.is_offline_mode():
    run_migrations_offline()
else:
    run_migrations_online()
