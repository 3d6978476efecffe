"""Volunteers as people: redeeming an invite for a personal credential, and bans.

An invite (a join token without a volunteer) can be used two ways. ``swarmgrad join URL
--token INVITE`` joins directly: every new key becomes a volunteer of its own. Or a person
opens the invite page, gives a display name and gets a *personal* join token: every machine
that joins with it counts as the same volunteer, under that name.

A ban revokes every token of the volunteer (its personal join tokens and its peers' peer
tokens), so its peers can no longer renew certificates, bootstrap or join again with the same
keys. The invites it came through may be shared with others, so a ban does not revoke them
by itself: it offers to (:func:`revoke_invites_used`), since with one a banned person could
come back with a new key. Reports on the hot path are authenticated from a per-worker
cache: a banned peer's reports may still be accepted for up to ``peer_auth_cache_ttl_s``.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

from sqlalchemy import or_, select, update
from sqlalchemy.orm import Session

from server.exceptions import Forbidden, NotFound
from server.models import Peer, Run, RunStatus, Token, TokenScope, Volunteer, utcnow
from server.security import mint_token, parse_token, secret_matches
from server.services import display_names
from server.services import runs as run_service


class InviteUnusable(Exception):
    """The invite cannot be used; ``str(exc)`` says why, in words for the person holding it.
    ``gone``: it existed and is spent (revoked, expired, used up, its run finished), as
    opposed to never having been an invite."""

    def __init__(self, message: str, *, gone: bool = True) -> None:
        super().__init__(message)
        self.gone = gone


class NameTaken(ValueError):
    """Another volunteer of the run already has this display name, or one a reader could
    take for it (:func:`server.services.display_names.comparison_key`)."""


@dataclass(frozen=True, slots=True)
class Invite:
    run: Run
    token: Token


@dataclass(frozen=True, slots=True)
class Redeemed:
    run: Run
    volunteer: Volunteer
    token: str  # the personal join token, in this answer only


def inspect_invite(session: Session, invite: str) -> Invite:
    """The run and join token behind an invite, if it can still be redeemed."""
    parsed = parse_token(invite)
    token = session.get(Token, parsed.id) if parsed is not None else None
    if (
        parsed is None
        or token is None
        or token.scope is not TokenScope.join
        or token.volunteer_id is not None  # a personal credential is not an invite
        or not secret_matches(parsed.secret, token.secret_hash)
        or token.run_id is None
    ):
        raise InviteUnusable("This invite is not valid.", gone=False)
    _check_usable(token)
    run = run_service.get_run(session, token.run_id)
    if run.archived_at is not None or run.status is RunStatus.finished:
        raise InviteUnusable("This run has finished; it takes no more volunteers.")
    return Invite(run, token)


def _check_usable(token: Token) -> None:
    now = utcnow()
    if token.revoked_at is not None:
        raise InviteUnusable("This invite was revoked.")
    if token.expires_at is not None and token.expires_at <= now:
        raise InviteUnusable("This invite has expired.")
    if token.max_uses is not None and token.uses >= token.max_uses:
        raise InviteUnusable("This invite has been used up.")


def redeem_invite(
    session: Session, invite: str, display_name: str, *, token_ttl_s: float
) -> Redeemed:
    """Use one use of the invite: a new volunteer named ``display_name`` and its personal join
    token (valid ``token_ttl_s``, any number of machines). The caller commits.

    The use is counted by a conditional UPDATE, so two people racing for an invite's last use
    cannot both get a credential."""
    name = display_names.clean(display_name)
    found = inspect_invite(session, invite)
    ensure_name_free(session, found.run.id, name)
    now = utcnow()
    claimed = session.execute(
        update(Token)
        .where(
            Token.id == found.token.id,
            Token.revoked_at.is_(None),
            or_(Token.expires_at.is_(None), Token.expires_at > now),
            or_(Token.max_uses.is_(None), Token.uses < Token.max_uses),
        )
        .values(uses=Token.uses + 1)
        .execution_options(synchronize_session=False)
    )
    # Session.execute is typed Result; an UPDATE's is a CursorResult, with rowcount.
    if claimed.rowcount != 1:  # type: ignore[attr-defined]
        session.refresh(found.token)
        _check_usable(found.token)
        raise InviteUnusable("This invite has been used up.")
    volunteer = Volunteer(
        run_id=found.run.id, display_name=name, join_token_id=found.token.id, created_at=now
    )
    session.add(volunteer)
    session.flush()
    new = mint_token(TokenScope.join)
    session.add(
        Token(
            id=new.id,
            scope=TokenScope.join,
            secret_hash=new.secret_hash,
            run_id=found.run.id,
            volunteer_id=volunteer.id,
            label=f"personal: {name}",
            created_at=now,
            expires_at=now + timedelta(seconds=token_ttl_s),
            uses=0,
        )
    )
    session.flush()
    return Redeemed(found.run, volunteer, new.plaintext)


def ensure_name_free(
    session: Session, run_id: str, name: str, *, exclude: int | None = None
) -> None:
    """:class:`NameTaken` if a volunteer of the run (other than ``exclude``) has ``name`` as
    people read it: the same after NFKC and case folding ("ADA" and "ada", "Straße" and
    "STRASSE"), or with the same UTS #39 confusable skeleton ("honest" and "h\u043enest" with
    a Cyrillic o). ``name`` is as :func:`server.services.display_names.clean` left it."""
    query = select(Volunteer.display_name).where(
        Volunteer.run_id == run_id, Volunteer.name_key == display_names.comparison_key(name)
    )
    if exclude is not None:
        query = query.where(Volunteer.id != exclude)
    existing = session.scalars(query.limit(1)).first()
    if existing is None:
        return
    if existing.casefold() == name.casefold():
        raise NameTaken(f"The display name “{name}” is already taken in this run; choose another.")
    raise NameTaken(
        f"The display name “{name}” looks like “{existing}”, which is already taken in this "
        "run; choose another."
    )


def get_volunteer(session: Session, run: Run, volunteer_id: int) -> Volunteer:
    volunteer = session.get(Volunteer, volunteer_id)
    if volunteer is None or volunteer.run_id != run.id:
        raise NotFound(f"run {run.id} has no volunteer {volunteer_id}")
    return volunteer


def ban(session: Session, run: Run, volunteer_id: int) -> Volunteer:
    """Ban a volunteer of ``run`` (idempotent): every token it holds is revoked. The caller
    commits."""
    volunteer = get_volunteer(session, run, volunteer_id)
    now = utcnow()
    if volunteer.banned_at is None:
        volunteer.banned_at = now
    peers = select(Peer.id).where(Peer.volunteer_id == volunteer.id)
    session.execute(
        update(Token)
        .where(
            or_(Token.volunteer_id == volunteer.id, Token.peer_id.in_(peers)),
            Token.revoked_at.is_(None),
        )
        .values(revoked_at=now)
        .execution_options(synchronize_session=False)
    )
    session.flush()
    return volunteer


def invites_used(session: Session, volunteer: Volunteer) -> list[Token]:
    """The invites ``volunteer`` came through (revoked or not): the one it redeemed for its
    personal credential, or the one its key joined with. A ban revokes the volunteer's own
    tokens, not these (others may share them); the organizer is offered to revoke them, so
    the banned person cannot come back through the same invite with a new key."""
    if volunteer.join_token_id is None:
        return []
    token = session.get(Token, volunteer.join_token_id)
    if token is None or token.scope is not TokenScope.join or token.volunteer_id is not None:
        return []
    return [token]


def revoke_invites_used(session: Session, run: Run, volunteer_id: int) -> list[Token]:
    """Revoke the invites the volunteer came through (:func:`invites_used`); the ones this
    revoked. The caller commits."""
    volunteer = get_volunteer(session, run, volunteer_id)
    now = utcnow()
    revoked = []
    for token in invites_used(session, volunteer):
        if token.revoked_at is None:
            token.revoked_at = now
            revoked.append(token)
    session.flush()
    return revoked


def ensure_not_banned(volunteer: Volunteer | None) -> None:
    if volunteer is not None and volunteer.banned_at is not None:
        raise Forbidden("banned from this run")


def personal_volunteer(session: Session, join_token_id: str) -> Volunteer | None:
    """The volunteer a personal join token belongs to (None for an invite); 403 if banned."""
    token = session.get(Token, join_token_id)
    if token is None or token.volunteer_id is None:
        return None
    volunteer = session.get(Volunteer, token.volunteer_id)
    ensure_not_banned(volunteer)
    return volunteer
