"""`swarmgrad coordinator ...` commands.

``swarmgrad coordinator`` serves the API with uvicorn; ``swarmgrad coordinator admin-token``
mints an organizer token. Settings come from ``SWARMGRAD_*`` variables; the options here
override the most common ones. The environment is production unless ``--dev`` (or
``SWARMGRAD_ENVIRONMENT=development``) says otherwise: without a real
``SWARMGRAD_SECRET_KEY`` the coordinator refuses to start, with one line saying why.
"""

from __future__ import annotations

import os
import sys
import warnings

import typer
from pydantic import ValidationError

from server.config import Settings

app = typer.Typer(help="Run the Swarmgrad coordinator.")

DatabaseUrlOption = typer.Option(
    None,
    "--database-url",
    help="SQLAlchemy URL (default: SWARMGRAD_DATABASE_URL, else ./swarmgrad.db).",
)
DevOption = typer.Option(
    False,
    "--dev",
    help="Development mode: a missing or placeholder secret key is only warned about "
    "(never for a coordinator others can reach).",
)


def _settings(database_url: str | None, dev: bool = False) -> Settings:
    # Through the environment, so that uvicorn's worker processes see them too.
    if database_url is not None:
        os.environ["SWARMGRAD_DATABASE_URL"] = database_url
    if dev:
        os.environ["SWARMGRAD_ENVIRONMENT"] = "development"
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            settings = Settings()
    except ValidationError as exc:
        messages = "; ".join(
            str(error["msg"]).removeprefix("Value error, ") for error in exc.errors()
        )
        typer.echo(f"error: invalid coordinator settings: {messages}", err=True)
        raise typer.Exit(2) from None
    for warning in caught:  # one line each, not Python's two with a source line
        typer.echo(f"warning: {warning.message}", err=True)
    return settings


def _migrate(settings: Settings) -> None:
    from server.db import make_engine, upgrade_database

    engine = make_engine(settings)
    try:
        upgrade_database(engine)
    finally:
        engine.dispose()


@app.callback(invoke_without_command=True)
def serve(
    ctx: typer.Context,
    host: str = typer.Option("127.0.0.1", help="Interface to listen on (0.0.0.0 for all)."),
    port: int = typer.Option(8000, help="TCP port."),
    database_url: str | None = DatabaseUrlOption,
    workers: int = typer.Option(
        1, min=1, help="Worker processes (use PostgreSQL beyond a few workers)."
    ),
    log_level: str = typer.Option("info", help="uvicorn log level."),
    dev: bool = DevOption,
) -> None:
    """Start the coordinator (migrations are applied first)."""
    ctx.obj = {"database_url": database_url, "dev": dev}
    if ctx.invoked_subcommand is not None:
        return
    import uvicorn

    settings = _settings(database_url, dev)
    # Migrate once here, before any worker starts, so workers never race on a fresh database.
    _migrate(settings)
    typer.echo(f"Swarmgrad coordinator on http://{host}:{port} (API docs at /docs)", err=True)
    uvicorn.run(
        "server.app:app_from_env",
        factory=True,
        host=host,
        port=port,
        workers=workers,
        log_level=log_level,
        # The app resolves X-Forwarded-For itself, from SWARMGRAD_TRUSTED_PROXIES only.
        proxy_headers=False,
    )


@app.command("admin-token")
def admin_token(
    ctx: typer.Context,
    label: str | None = typer.Option(None, help="A note to recognise the token by."),
    database_url: str | None = DatabaseUrlOption,
    dev: bool = DevOption,
) -> None:
    """Create an organizer token and print it (once: only its hash is stored)."""
    from server.db import make_engine, make_session_factory, session_scope
    from server.services.tokens import create_organizer_token

    url = database_url or (ctx.obj or {}).get("database_url")
    settings = _settings(url, dev or bool((ctx.obj or {}).get("dev")))
    _migrate(settings)
    engine = make_engine(settings)
    try:
        with session_scope(make_session_factory(engine)) as session:
            _, plaintext = create_organizer_token(session, label=label)
    finally:
        engine.dispose()
    typer.echo(plaintext)
    if sys.stdout.isatty():
        typer.echo(
            "Organizer token created. It is shown only now; use it as "
            "'Authorization: Bearer <token>'.",
            err=True,
        )
