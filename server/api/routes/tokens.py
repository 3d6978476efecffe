"""Join tokens (invites) of a run, and organizer tokens: create (shown once), list without
secrets, revoke."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Path, status

from server.api import API_PREFIX
from server.api.deps import CurrentOrganizer, RunDep, SessionDep, SettingsDep
from server.exceptions import NotFound
from server.models import Token
from server.schemas import (
    OrganizerTokenCreate,
    OrganizerTokenCreated,
    OrganizerTokenPublic,
    OrganizerTokensPublic,
    TokenCreate,
    TokenCreated,
    TokenPublic,
    TokensPublic,
)
from server.services import tokens as token_service

router = APIRouter(prefix=f"{API_PREFIX}/runs/{{run_id}}/tokens", tags=["tokens"])
organizer_router = APIRouter(prefix=f"{API_PREFIX}/tokens", tags=["tokens"])
TokenIdPath = Annotated[str, Path(min_length=1, max_length=32, description="The token's id.")]


def token_public(token: Token) -> TokenPublic:
    return TokenPublic(
        id=token.id,
        label=token.label,
        created_at=token.created_at,
        expires_at=token.expires_at,
        max_uses=token.max_uses,
        uses=token.uses,
        revoked_at=token.revoked_at,
        active=token_service.is_active(token),
    )


@router.post("", status_code=status.HTTP_201_CREATED, response_model=TokenCreated)
def create_join_token(
    _: CurrentOrganizer,
    session: SessionDep,
    settings: SettingsDep,
    run: RunDep,
    body: TokenCreate,
) -> TokenCreated:
    """A join token for volunteers. The token is in this answer only; it is stored hashed.
    Without ``expires_in_s`` or ``max_uses`` it gets the coordinator's defaults
    (``join_token_default_ttl_s``, ``join_token_default_max_uses``)."""
    token, plaintext = token_service.create_join_token(
        session,
        run,
        body,
        settings.join_token_default_ttl_s,
        settings.join_token_default_max_uses,
    )
    session.commit()
    return TokenCreated(
        id=token.id,
        token=plaintext,
        expires_at=token.expires_at,
        max_uses=token.max_uses,
        label=token.label,
    )


@router.get("", response_model=TokensPublic)
def list_join_tokens(_: CurrentOrganizer, session: SessionDep, run: RunDep) -> TokensPublic:
    return TokensPublic(
        tokens=[token_public(t) for t in token_service.list_join_tokens(session, run)]
    )


@router.delete("/{token_id}", status_code=status.HTTP_204_NO_CONTENT)
def revoke_join_token(
    _: CurrentOrganizer,
    session: SessionDep,
    run: RunDep,
    token_id: str = Path(min_length=1, max_length=32),
) -> None:
    """Revoke a join token: nobody can join with it any more (peers that joined stay)."""
    token = token_service.get_join_token(session, run, token_id)
    if token is None:
        raise NotFound(f"run {run.id} has no join token {token_id!r}")
    token_service.revoke(session, token)
    session.commit()


# ---------------------------------------------------------------------------- organizer tokens


def organizer_token_public(token: Token, caller: str) -> OrganizerTokenPublic:
    return OrganizerTokenPublic(
        id=token.id,
        label=token.label,
        created_at=token.created_at,
        expires_at=token.expires_at,
        revoked_at=token.revoked_at,
        active=token_service.is_active(token),
        current=token.id == caller,
    )


@organizer_router.get("", response_model=OrganizerTokensPublic)
def list_organizer_tokens(
    organizer: CurrentOrganizer, session: SessionDep
) -> OrganizerTokensPublic:
    """Every organizer token stored in the database, revoked ones included, without secrets
    (``SWARMGRAD_ADMIN_TOKEN``, if set, is not among them)."""
    return OrganizerTokensPublic(
        tokens=[
            organizer_token_public(t, organizer.token_id)
            for t in token_service.list_organizer_tokens(session)
        ]
    )


@organizer_router.post(
    "", status_code=status.HTTP_201_CREATED, response_model=OrganizerTokenCreated
)
def create_organizer_token(
    _: CurrentOrganizer, session: SessionDep, body: OrganizerTokenCreate
) -> OrganizerTokenCreated:
    """A new organizer token. The token is in this answer only; it is stored hashed.
    Without ``expires_in_s`` it does not expire."""
    token, plaintext = token_service.create_organizer_token(session, body.label, body.expires_in_s)
    session.commit()
    return OrganizerTokenCreated(
        id=token.id, token=plaintext, label=token.label, expires_at=token.expires_at
    )


@organizer_router.delete("/{token_id}", status_code=status.HTTP_204_NO_CONTENT)
def revoke_organizer_token(
    organizer: CurrentOrganizer, session: SessionDep, settings: SettingsDep, token_id: TokenIdPath
) -> None:
    """Revoke an organizer token (idempotent). 409 for the caller's own token while it is
    the last active one and no ``SWARMGRAD_ADMIN_TOKEN`` is set."""
    token_service.revoke_organizer_token(
        session, token_id, caller=organizer, admin_configured=settings.admin_token is not None
    )
    session.commit()
