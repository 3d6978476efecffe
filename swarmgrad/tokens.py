"""The organizer's commands for credentials: ``swarmgrad invite`` (a run's invites, the
tokens volunteers join with) and ``swarmgrad tokens ...`` (organizer tokens), over the
coordinator's API with the options and output of :mod:`swarmgrad.organizer`.
"""

from __future__ import annotations

import shlex
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from swarmgrad.organizer import (
    DEFAULT_URL,
    JsonOption,
    RunArgument,
    TokenOption,
    UrlOption,
    cell_text,
    duration_option,
    emit,
    open_client,
    require_token,
)

tokens_app = typer.Typer(
    help="List, create and revoke organizer tokens (through the coordinator's API).",
    no_args_is_help=True,
)


# ---------------------------------------------------------------------------- invite


def invite(
    run_id: RunArgument,
    uses: Annotated[
        int | None,
        typer.Option(
            "--uses",
            min=1,
            help="How many volunteers may join with it (default: the coordinator's, 100).",
        ),
    ] = None,
    expires: Annotated[
        str | None,
        typer.Option(
            "--expires",
            help="Lifetime like 30m, 12h or 7d (default: the coordinator's, 7 days).",
            show_default=False,
        ),
    ] = None,
    label: Annotated[
        str | None, typer.Option("--label", help="A note to recognise the invite by.")
    ] = None,
    url: UrlOption = DEFAULT_URL,
    token: TokenOption = None,
    as_json: JsonOption = False,
) -> None:
    """Make an invite for volunteers: prints its link, the token and the `swarmgrad join` command."""
    expires_in_s = duration_option(expires, "--expires")
    token = require_token(token)
    with open_client(url) as client:
        created = client.create_invite(
            token, run_id, max_uses=uses, expires_in_s=expires_in_s, label=label
        )
        url = client.url
    command = f"swarmgrad join {shlex.quote(url)} --token {shlex.quote(created.token)}"
    # The invite page: a display name there gives the volunteer a personal credential.
    link = f"{url.rstrip('/')}/join/{created.token}"
    document = {
        **created.model_dump(mode="json"),
        "run_id": run_id,
        "url": url,
        "command": command,
        "link": link,
    }

    def render(console: Console) -> None:
        console.print(f"Invite token: {created.token}", soft_wrap=True)
        limits = [
            f"{created.max_uses} use(s)" if created.max_uses else "unlimited uses",
            f"expires {created.expires_at}" if created.expires_at else "no expiry",
        ]
        console.print(f"({', '.join(limits)}; shown only now)")
        console.print(
            "Send volunteers this link (they pick a display name and get their own token):"
        )
        console.print(f"  {link}", soft_wrap=True)
        console.print("or have them run:")
        console.print(f"  {command}", soft_wrap=True)

    emit(as_json, document, render)


# ---------------------------------------------------------------------------- tokens


@tokens_app.command("list")
def list_tokens(
    url: UrlOption = DEFAULT_URL, token: TokenOption = None, as_json: JsonOption = False
) -> None:
    """List the organizer tokens, oldest first (never their secrets)."""
    token = require_token(token)
    with open_client(url) as client:
        tokens = client.list_organizer_tokens(token)

    def render(console: Console) -> None:
        table = Table(title="Organizer tokens", title_justify="left")
        for column in ("id", "state", "label", "created", "expires"):
            table.add_column(column, overflow="fold")
        for row in tokens:
            state = "active" if row.active else "revoked" if row.revoked_at else "expired"
            if row.current:
                state += " (this one)"
            table.add_row(
                row.id,
                state,
                cell_text(row.label),
                cell_text(row.created_at),
                cell_text(row.expires_at),
            )
        console.print(table)

    emit(as_json, tokens, render)


@tokens_app.command("create")
def create_token(
    label: Annotated[
        str | None, typer.Option("--label", help="A note to recognise the token by.")
    ] = None,
    expires: Annotated[
        str | None,
        typer.Option(
            "--expires", help="Lifetime like 12h or 30d (default: none).", show_default=False
        ),
    ] = None,
    url: UrlOption = DEFAULT_URL,
    token: TokenOption = None,
    as_json: JsonOption = False,
) -> None:
    """Create an organizer token and print it (shown only now)."""
    expires_in_s = duration_option(expires, "--expires")
    token = require_token(token)
    with open_client(url) as client:
        created = client.create_organizer_token(token, label=label, expires_in_s=expires_in_s)

    def render(console: Console) -> None:
        console.print(f"Organizer token: {created.token}", soft_wrap=True)
        expiry = f"expires {created.expires_at}" if created.expires_at else "no expiry"
        console.print(f"(id {created.id}, {expiry}; shown only now)")

    emit(as_json, created, render)


@tokens_app.command("revoke")
def revoke_token(
    token_id: Annotated[str, typer.Argument(help="The token's id (see `swarmgrad tokens list`).")],
    url: UrlOption = DEFAULT_URL,
    token: TokenOption = None,
) -> None:
    """Revoke an organizer token; it stops working at once."""
    token = require_token(token)
    with open_client(url) as client:
        client.revoke_organizer_token(token, token_id)
    typer.echo(f"revoked organizer token {token_id}")
