"""The coordinator's extra: ``pip install swarmgrad`` is the volunteer's install; the commands
that run a coordinator (``swarmgrad coordinator``, ``swarmgrad demo``) need the server stack of
``pip install "swarmgrad[coordinator]"`` and say so, in one line, where it is missing."""

from __future__ import annotations

import importlib.util

from swarmgrad.errors import CommandError

COORDINATOR_INSTALL = 'pip install "swarmgrad[coordinator]"'

# What `server` imports whatever its settings (psycopg only for PostgreSQL, uvloop and
# httptools only where uvicorn finds them).
COORDINATOR_MODULES = (
    "fastapi",
    "uvicorn",
    "sqlalchemy",
    "alembic",
    "pydantic_settings",
    "jinja2",
    "prometheus_client",
)


def missing_coordinator_modules() -> list[str]:
    """The modules of the coordinator's extra this environment cannot import."""
    return [name for name in COORDINATOR_MODULES if importlib.util.find_spec(name) is None]


def require_coordinator(command: str) -> None:
    """:class:`CommandError` naming the install command if the coordinator's extra is missing."""
    missing = missing_coordinator_modules()
    if missing:
        raise CommandError(
            f"`swarmgrad {command}` runs a coordinator, which this install lacks "
            f"({', '.join(missing)}): {COORDINATOR_INSTALL}"
        )
