"""Minting, listing, revoking and checking bearer tokens."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta

from sqlalchemy import or_, select, update
from sqlalchemy.orm import Session

from server.exceptions import Conflict, NotFound, Unauthenticated
from server.models import Run, Token, TokenScope, utcnow
from server.schemas import TokenCreate
from server.security import constant_time_equals, mint_token, parse_token, secret_matches

ADMIN_TOKEN_ID = "settings"


@dataclass(frozen=True, slots=True)
class Principal:
    """Who is calling: the scope of their token and what it is bound to."""

    scope: TokenScope
    token_id: str
    run_id: str | None = None
    peer_pk: int | None = None


def create_organizer_token(
    session: Session, label: str | None = None, expires_in_s: float | None = None
) -> tuple[Token, str]:
    """An organizer token (without ``expires_in_s``, it never expires) and its plaintext
    (show it once)."""
    new = mint_token(TokenScope.organizer)
    now = utcnow()
    token = Token(
        id=new.id,
        scope=TokenScope.organizer,
        secret_hash=new.secret_hash,
        label=label,
        created_at=now,
        expires_at=None if expires_in_s is None else now + timedelta(seconds=expires_in_s),
        uses=0,
    )
    session.add(token)
    session.flush()
    return token, new.plaintext


def list_organizer_tokens(session: Session) -> list[Token]:
    query = (
        select(Token)
        .where(Token.scope == TokenScope.organizer)
        .order_by(Token.created_at, Token.id)
    )
    return list(session.scalars(query))


def get_organizer_token(session: Session, token_id: str) -> Token:
    """The organizer token ``token_id``, or :class:`NotFound` (also for other scopes)."""
    token = session.get(Token, token_id)
    if token is None or token.scope is not TokenScope.organizer:
        raise NotFound(f"no organizer token {token_id!r}; list them with GET /api/v1/tokens")
    return token


def revoke_organizer_token(
    session: Session, token_id: str, *, caller: Principal | None, admin_configured: bool
) -> Token:
    """Revoke an organizer token (idempotent). The caller commits.

    So that organizers cannot lock themselves out, a caller may not revoke its own token
    while it is the last active organizer token, unless ``SWARMGRAD_ADMIN_TOKEN`` is set
    (409). ``caller`` is None for the command line, which reaches the database directly
    and can always mint a new token.
    """
    token = get_organizer_token(session, token_id)
    if token.revoked_at is not None:
        return token
    if caller is not None and caller.token_id == token.id and not admin_configured:
        # Locked on PostgreSQL, so that two organizers revoking their own tokens at the
        # same moment cannot both count the other's as still active.
        unrevoked = session.scalars(
            select(Token)
            .where(Token.scope == TokenScope.organizer, Token.revoked_at.is_(None))
            .with_for_update()
        ).all()
        now = utcnow()
        if not any(t.id != token.id and is_active(t, now) for t in unrevoked):
            raise Conflict(
                "this is the last active organizer token and no SWARMGRAD_ADMIN_TOKEN is "
                "set: revoking it would lock every organizer out. Create another token "
                "first (POST /api/v1/tokens), or revoke it with `swarmgrad coordinator "
                "tokens revoke`"
            )
    revoke(session, token)
    return token


def create_join_token(
    session: Session, run: Run, data: TokenCreate, default_ttl_s: float, default_max_uses: int
) -> tuple[Token, str]:
    """An invite to ``run``: the token row and its plaintext (show it once). An invite made
    without an expiry or a limit gets ``default_ttl_s`` and ``default_max_uses``: every
    invite ends, by time and by use."""
    new = mint_token(TokenScope.join)
    now = utcnow()
    ttl = data.expires_in_s if data.expires_in_s is not None else default_ttl_s
    token = Token(
        id=new.id,
        scope=TokenScope.join,
        secret_hash=new.secret_hash,
        run_id=run.id,
        label=data.label,
        created_at=now,
        expires_at=now + timedelta(seconds=ttl),
        max_uses=data.max_uses if data.max_uses is not None else default_max_uses,
        uses=0,
    )
    session.add(token)
    session.flush()
    return token, new.plaintext


def create_peer_token(session: Session, run_id: str, peer_pk: int, ttl_s: float) -> str:
    """A token for one peer, valid ``ttl_s`` (each certificate renewal extends it, see
    :func:`extend_peer_token`); earlier tokens of that peer are revoked (rotation on
    re-join)."""
    now = utcnow()
    session.execute(
        update(Token)
        .where(Token.peer_id == peer_pk, Token.revoked_at.is_(None))
        .values(revoked_at=now)
    )
    new = mint_token(TokenScope.peer)
    session.add(
        Token(
            id=new.id,
            scope=TokenScope.peer,
            secret_hash=new.secret_hash,
            run_id=run_id,
            peer_id=peer_pk,
            created_at=now,
            expires_at=now + timedelta(seconds=ttl_s),
            uses=0,
        )
    )
    session.flush()
    return new.plaintext


def extend_peer_token(
    session: Session, token_id: str, ttl_s: float, now: datetime | None = None
) -> None:
    """Slide a peer token's expiry to ``ttl_s`` from ``now``: an active peer (one that
    renews its certificate) never sees its token expire. Only ever moves it later, and
    never revives a revoked or expired token."""
    now = now or utcnow()
    expires_at = now + timedelta(seconds=ttl_s)
    session.execute(
        update(Token)
        .where(
            Token.id == token_id,
            Token.scope == TokenScope.peer,
            Token.revoked_at.is_(None),
            or_(Token.expires_at.is_(None), Token.expires_at.between(now, expires_at)),
        )
        .values(expires_at=expires_at)
        .execution_options(synchronize_session=False)
    )


def list_join_tokens(session: Session, run: Run) -> list[Token]:
    query = (
        select(Token)
        .where(Token.run_id == run.id, Token.scope == TokenScope.join)
        .order_by(Token.created_at, Token.id)
    )
    return list(session.scalars(query))


def get_join_token(session: Session, run: Run, token_id: str) -> Token | None:
    token = session.get(Token, token_id)
    if token is None or token.scope is not TokenScope.join or token.run_id != run.id:
        return None
    return token


def revoke(session: Session, token: Token) -> None:
    if token.revoked_at is None:
        token.revoked_at = utcnow()
        session.flush()


def is_active(token: Token, now: datetime | None = None) -> bool:
    now = now or utcnow()
    return (
        token.revoked_at is None
        and (token.expires_at is None or token.expires_at > now)
        and (token.max_uses is None or token.uses < token.max_uses)
    )


def _why_inactive(token: Token, now: datetime, *, count_uses: bool = True) -> str | None:
    kind = f"{token.scope.value} token"
    if token.revoked_at is not None:
        return f"this {kind} was revoked"
    if token.expires_at is not None and token.expires_at <= now:
        return f"this {kind} expired at {token.expires_at.isoformat()}"
    if count_uses and token.max_uses is not None and token.uses >= token.max_uses:
        return f"this {kind} has been used its maximum of {token.max_uses} times"
    return None


def authenticate(
    session: Session, presented: str, admin_token: str | None, *, allow_used_up: bool = False
) -> Principal:
    """The principal behind a bearer token, or :class:`Unauthenticated` with the reason.

    The token's id selects the row; its secret is compared in constant time with the
    stored SHA-256 (an unknown id and a wrong secret give the same answer).
    ``allow_used_up`` accepts a token that has reached its ``max_uses`` (joining again
    with a known key uses nothing up; see :func:`server.services.peers.join`).
    """
    if admin_token is not None and constant_time_equals(presented, admin_token):
        return Principal(TokenScope.organizer, ADMIN_TOKEN_ID)
    parsed = parse_token(presented)
    if parsed is None:
        raise Unauthenticated("malformed bearer token; expected a token issued by this server")
    token = session.get(Token, parsed.id)
    if (
        token is None
        or token.scope is not parsed.scope
        or not secret_matches(parsed.secret, token.secret_hash)
    ):
        raise Unauthenticated("unknown or invalid bearer token")
    reason = _why_inactive(token, utcnow(), count_uses=not allow_used_up)
    if reason is not None:
        hint = (
            "; ask the organizer for a new invite"
            if token.scope is TokenScope.join
            else "; join the run again with an invite"
            if token.scope is TokenScope.peer
            else ""
        )
        raise Unauthenticated(reason + hint)
    return Principal(token.scope, token.id, token.run_id, token.peer_id)


def ensure_join_token_valid(session: Session, token_id: str) -> None:
    """:class:`Unauthenticated` unless the join token is unrevoked and unexpired (its uses
    are not counted: for joins that use nothing up)."""
    token = session.get(Token, token_id)
    reason = _why_inactive(token, utcnow(), count_uses=False) if token is not None else None
    if token is None or reason is not None:
        raise Unauthenticated(
            (reason or "this join token is no longer valid")
            + "; ask the organizer for a new invite"
        )


def consume_join_token(session: Session, token_id: str) -> None:
    """Count one use of a join token, atomically with respect to other workers: the
    conditional UPDATE matches only while the token is unrevoked, unexpired and under its
    limit, so two concurrent joins can never both take the last use."""
    now = utcnow()
    result = session.execute(
        update(Token)
        .where(
            Token.id == token_id,
            Token.revoked_at.is_(None),
            or_(Token.expires_at.is_(None), Token.expires_at > now),
            or_(Token.max_uses.is_(None), Token.uses < Token.max_uses),
        )
        .values(uses=Token.uses + 1)
        .execution_options(synchronize_session=False)
    )
    # Session.execute is typed Result; an UPDATE's is a CursorResult, with rowcount.
    if result.rowcount != 1:  # type: ignore[attr-defined]
        token = session.get(Token, token_id, populate_existing=True)
        reason = _why_inactive(token, now) if token is not None else None
        raise Unauthenticated(
            (reason or "this join token is no longer valid")
            + "; ask the organizer for a new invite"
        )
