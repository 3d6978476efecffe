"""`swarmgrad coordinator ...` commands.

``swarmgrad coordinator`` serves the API with uvicorn; ``swarmgrad coordinator admin-token``
mints an organizer token, ``... tokens list|create|revoke`` manages them, ``... rotate-key``
re-seals run keys after a change of the secret key. Settings come from ``SWARMGRAD_*`` variables; the options here
override the most common ones. The environment is production unless ``--dev`` (or
``SWARMGRAD_ENVIRONMENT=development``) says otherwise: without a real
``SWARMGRAD_SECRET_KEY`` the coordinator refuses to start, with one line saying why.
"""

from __future__ import annotations

import contextlib
import os
import sys
import warnings
from collections.abc import Iterator
from datetime import datetime
from typing import TYPE_CHECKING

import typer
from pydantic import ValidationError

from peer.formats.durations import parse_duration
from server.config import Settings

if TYPE_CHECKING:
    from sqlalchemy.orm import Session

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

    from server.http_guard import ConnectionGuard, guarded_protocol

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
        # A deadline for request headers and caps on connections, which uvicorn lacks.
        http=guarded_protocol(
            ConnectionGuard(
                header_timeout_s=settings.http_header_timeout_s,
                max_connections=settings.http_max_connections,
                max_pending_per_source=settings.http_max_pending_per_source,
                max_header_bytes=settings.http_max_header_bytes,
                ipv6_prefix=settings.rate_limit_ipv6_prefix,
                exempt=settings.trusted_proxies,
            )
        ),
        timeout_keep_alive=settings.http_keep_alive_s,
    )


@contextlib.contextmanager
def _database(
    ctx: typer.Context, database_url: str | None, dev: bool
) -> Iterator[tuple[Settings, Session]]:
    """Settings and a session on the migrated database, committed on success. A
    coordinator error (an unknown id) becomes one line on stderr and exit status 1."""
    from server.db import make_engine, make_session_factory, session_scope
    from server.exceptions import CoordinatorError

    options = ctx.find_root().obj or {}
    settings = _settings(
        database_url or options.get("database_url"), dev or bool(options.get("dev"))
    )
    _migrate(settings)
    engine = make_engine(settings)
    try:
        with session_scope(make_session_factory(engine)) as session:
            yield settings, session
    except CoordinatorError as exc:
        typer.echo(f"error: {exc.detail}", err=True)
        raise typer.Exit(1) from None
    finally:
        engine.dispose()


def _print_new_token(plaintext: str) -> None:
    typer.echo(plaintext)
    if sys.stdout.isatty():
        typer.echo(
            "Organizer token created. It is shown only now; use it as "
            "'Authorization: Bearer <token>'.",
            err=True,
        )


@app.command("admin-token")
def admin_token(
    ctx: typer.Context,
    label: str | None = typer.Option(None, help="A note to recognise the token by."),
    database_url: str | None = DatabaseUrlOption,
    dev: bool = DevOption,
) -> None:
    """Create an organizer token and print it (once: only its hash is stored)."""
    from server.services.tokens import create_organizer_token

    with _database(ctx, database_url, dev) as (_, session):
        _, plaintext = create_organizer_token(session, label=label)
    _print_new_token(plaintext)


tokens_app = typer.Typer(help="List, create and revoke organizer tokens.", no_args_is_help=True)
app.add_typer(tokens_app, name="tokens")


def _when(value: datetime | None) -> str:
    return "-" if value is None else value.strftime("%Y-%m-%d %H:%M UTC")


@tokens_app.command("list")
def list_tokens(
    ctx: typer.Context, database_url: str | None = DatabaseUrlOption, dev: bool = DevOption
) -> None:
    """Every organizer token in the database, without secrets, oldest first."""
    from server.services.tokens import is_active, list_organizer_tokens

    with _database(ctx, database_url, dev) as (_, session):
        rows = [
            (
                t.id,
                "revoked" if t.revoked_at else "active" if is_active(t) else "expired",
                _when(t.created_at),
                _when(t.expires_at),
                t.label or "",
            )
            for t in list_organizer_tokens(session)
        ]
    if not rows:
        typer.echo("no organizer tokens; create one with `swarmgrad coordinator tokens create`")
        return
    header = ("ID", "STATE", "CREATED", "EXPIRES", "LABEL")
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header) - 1)]
    for row in [header, *rows]:
        typer.echo("  ".join([*(c.ljust(w) for c, w in zip(row, widths, strict=False)), row[-1]]))


@tokens_app.command("create")
def create_token(
    ctx: typer.Context,
    label: str | None = typer.Option(None, help="A note to recognise the token by."),
    expires_in: str | None = typer.Option(
        None, "--expires-in", help="Lifetime, e.g. 12h, 30d (default: no expiry)."
    ),
    database_url: str | None = DatabaseUrlOption,
    dev: bool = DevOption,
) -> None:
    """Create an organizer token and print it (once: only its hash is stored)."""
    from server.services.tokens import create_organizer_token

    try:
        expires_in_s = None if expires_in is None else parse_duration(expires_in)
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="'--expires-in'") from None
    with _database(ctx, database_url, dev) as (_, session):
        _, plaintext = create_organizer_token(session, label=label, expires_in_s=expires_in_s)
    _print_new_token(plaintext)


@tokens_app.command("revoke")
def revoke_token(
    ctx: typer.Context,
    token_id: str = typer.Argument(..., help="The token's id (see `tokens list`)."),
    database_url: str | None = DatabaseUrlOption,
    dev: bool = DevOption,
) -> None:
    """Revoke an organizer token; it stops working at once. Allowed for the last one too:
    `tokens create` (or `admin-token`) makes a new one."""
    from server.services.tokens import revoke_organizer_token

    with _database(ctx, database_url, dev) as (_, session):
        revoke_organizer_token(session, token_id, caller=None, admin_configured=False)
    typer.echo(f"revoked organizer token {token_id}")


@app.command("rotate-key")
def rotate_key(
    ctx: typer.Context, database_url: str | None = DatabaseUrlOption, dev: bool = DevOption
) -> None:
    """Re-seal every run's signing key still sealed under SWARMGRAD_SECRET_KEY_PREVIOUS with
    SWARMGRAD_SECRET_KEY, in one transaction (see docs/coordinator.md, "Rotating the secret
    key"). Safe to run again."""
    from server.security import KeyBox
    from server.services.runs import reseal_run_keys

    with _database(ctx, database_url, dev) as (settings, session):
        secret, previous = settings.secret_keys()
        try:
            resealed = reseal_run_keys(session, KeyBox(secret, previous))
        except ValueError as exc:
            typer.echo(f"error: nothing re-sealed: {exc}", err=True)
            raise typer.Exit(1) from None
    typer.echo(f"re-sealed {resealed} run key(s) under the current SWARMGRAD_SECRET_KEY")
    if previous is None and resealed == 0:
        typer.echo("(SWARMGRAD_SECRET_KEY_PREVIOUS is not set: nothing to rotate)", err=True)
