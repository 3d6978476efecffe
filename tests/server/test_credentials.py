"""Credential lifecycle: peer tokens that expire unless their peer renews, organizer tokens
managed through the API, and rotation of the secret key (SQLite and PostgreSQL)."""

from __future__ import annotations

import base64
from datetime import datetime, timedelta
from typing import Any

import httpx
import pytest
from fastapi import FastAPI
from sqlalchemy import create_engine, select, update
from typer.testing import CliRunner

from peer.formats.identity import Identity
from peer.formats.revocation import RevocationBook
from server.app import create_app
from server.cli import app as cli
from server.config import Settings
from server.models import Run, Token, TokenScope, utcnow
from server.security import ChallengeRefused, JoinChallenges, KeyBox
from server.services import tokens as token_service
from swarmgrad.cli import main
from tests.server.conftest import (
    ORGANIZER,
    SECRET_KEY,
    Api,
    JoinedPeer,
    bearer,
    client_for,
    join_proof,
    make_settings,
    running,
)

KEY_B = "rotated-secret-" + "b" * 40


def _expiry(app: FastAPI, token_id: str) -> datetime:
    with app.state.session_factory() as session:
        token = session.get(Token, token_id)
        assert token is not None and token.expires_at is not None
        return token.expires_at


def _token_id(plaintext: str) -> str:
    return plaintext.split("_")[1]


# ---------------------------------------------------------------------------- peer tokens


async def test_a_peer_token_expires_unless_its_peer_renews(
    app: FastAPI, client: httpx.AsyncClient, api: Api, run: dict[str, Any], join_token: str
) -> None:
    ttl = timedelta(seconds=app.state.settings.peer_token_ttl_s)
    before = utcnow()
    peer = await api.join(run["id"], join_token)
    token_id = _token_id(peer.body["peer_token"])
    issued = _expiry(app, token_id)
    assert before + ttl <= issued <= utcnow() + ttl

    # A renewal slides the expiry to a full lifetime from now; an earlier expiry (the
    # peer was quiet for most of it) shows the slide.
    with app.state.session_factory() as session, session.begin():
        session.execute(
            update(Token).where(Token.id == token_id).values(expires_at=utcnow() + timedelta(1))
        )
    renew = f"/api/v1/runs/{run['id']}/certificate"
    before = utcnow()
    assert (await client.post(renew, headers=peer.headers)).status_code == 200
    assert _expiry(app, token_id) >= before + ttl

    # Away longer than the lifetime: every peer call is refused, saying what to do.
    with app.state.session_factory() as session, session.begin():
        session.execute(
            update(Token)
            .where(Token.id == token_id)
            .values(expires_at=utcnow() - timedelta(seconds=1))
        )
    refused = await client.post(renew, headers=peer.headers)
    assert refused.status_code == 401
    detail = refused.json()["detail"]
    assert "peer token expired" in detail and "invite" in detail
    assert (await api.report(run["id"], peer)).status_code == 401
    # ... and the refused renewal did not revive it.
    assert _expiry(app, token_id) < utcnow()

    # Joining again with an invite gives the same peer a fresh token.
    again = await api.join(run["id"], join_token, peer.identity)
    assert again.body["peer_id"] == peer.body["peer_id"]
    assert (await client.post(renew, headers=again.headers)).status_code == 200


def test_an_expiry_only_slides_forward_and_never_revives(app: FastAPI) -> None:
    now = utcnow()
    with app.state.session_factory() as session, session.begin():
        live = Token(
            id="a" * 16, scope=TokenScope.peer, secret_hash=b"x" * 32, created_at=now, uses=0
        )
        live.expires_at = now + timedelta(days=20)
        revoked = Token(
            id="b" * 16, scope=TokenScope.peer, secret_hash=b"y" * 32, created_at=now, uses=0
        )
        revoked.expires_at, revoked.revoked_at = now + timedelta(days=1), now
        session.add_all([live, revoked])
    with app.state.session_factory() as session, session.begin():
        token_service.extend_peer_token(session, "a" * 16, 14 * 86400, now)  # earlier: kept
        token_service.extend_peer_token(session, "b" * 16, 14 * 86400, now)  # revoked: kept
    assert _expiry(app, "a" * 16) == now + timedelta(days=20)
    assert _expiry(app, "b" * 16) == now + timedelta(days=1)
    with app.state.session_factory() as session, session.begin():
        token_service.extend_peer_token(session, "a" * 16, 30 * 86400, now)
    assert _expiry(app, "a" * 16) == now + timedelta(days=30)


def test_peer_tokens_must_outlive_certificates() -> None:
    with pytest.raises(ValueError, match="PEER_TOKEN_TTL_S"):
        make_settings("sqlite://", peer_token_ttl_s=3600, certificate_ttl_s=7200)


# ---------------------------------------------------------------------------- organizer tokens


async def test_organizer_tokens_through_the_api(
    client: httpx.AsyncClient, api: Api, run: dict[str, Any], join_token: str
) -> None:
    created = await client.post(
        "/api/v1/tokens", json={"label": "ci", "expires_in_s": 3600}, headers=ORGANIZER
    )
    assert created.status_code == 201, created.text
    new = created.json()
    assert new["token"].startswith("sgo_") and new["label"] == "ci"
    assert new["expires_at"] is not None

    listed = await client.get("/api/v1/tokens", headers=bearer(new["token"]))
    assert listed.status_code == 200
    (row,) = listed.json()["tokens"]
    assert row["id"] == new["id"] and row["active"] and row["current"]
    assert "token" not in row and "secret_hash" not in row and new["token"] not in listed.text

    # Only organizers: a join token is refused, before the unknown id is looked at.
    assert (await client.get("/api/v1/tokens", headers=bearer(join_token))).status_code == 403
    missing = await client.delete("/api/v1/tokens/" + "0" * 16, headers=ORGANIZER)
    assert missing.status_code == 404
    not_organizer = await client.delete(
        f"/api/v1/tokens/{_token_id(join_token)}", headers=ORGANIZER
    )
    assert not_organizer.status_code == 404  # a join token is not managed here

    # Revoking: the token stops working; again is a no-op.
    gone = await client.delete(f"/api/v1/tokens/{new['id']}", headers=ORGANIZER)
    assert gone.status_code == 204
    assert (
        await client.delete(f"/api/v1/tokens/{new['id']}", headers=ORGANIZER)
    ).status_code == 204
    refused = await client.get("/api/v1/tokens", headers=bearer(new["token"]))
    assert refused.status_code == 401 and "revoked" in refused.json()["detail"]
    (row,) = (await client.get("/api/v1/tokens", headers=ORGANIZER)).json()["tokens"]
    assert row["revoked_at"] is not None and not row["active"] and not row["current"]

    bad = await client.post("/api/v1/tokens", json={"expires_in_s": -1}, headers=ORGANIZER)
    assert bad.status_code == 422


async def test_the_last_organizer_token_cannot_revoke_itself(settings: Settings) -> None:
    no_admin = settings.model_copy(update={"admin_token": None})
    async with running(create_app(no_admin)) as app, client_for(app) as client:
        with app.state.session_factory() as session, session.begin():
            first, first_text = token_service.create_organizer_token(session, "first")
            first_id = first.id
        own = f"/api/v1/tokens/{first_id}"
        refused = await client.delete(own, headers=bearer(first_text))
        assert refused.status_code == 409
        assert "last active organizer token" in refused.json()["detail"]
        assert "SWARMGRAD_ADMIN_TOKEN" in refused.json()["detail"]

        second = (await client.post("/api/v1/tokens", json={}, headers=bearer(first_text))).json()
        assert (await client.delete(own, headers=bearer(first_text))).status_code == 204
        # Now the second is the last one: it may revoke others, not itself.
        last = await client.delete(
            f"/api/v1/tokens/{second['id']}", headers=bearer(second["token"])
        )
        assert last.status_code == 409


# ---------------------------------------------------------------------------- key rotation


def test_keybox_and_challenges_accept_the_previous_key_during_a_rotation() -> None:
    old, rotated, new_only = KeyBox(SECRET_KEY), KeyBox(KEY_B, SECRET_KEY), KeyBox(KEY_B)
    sealed = old.seal(b"private", b"run-1")
    assert rotated.open(sealed, b"run-1") == b"private"
    with pytest.raises(ValueError, match="SECRET_KEY_PREVIOUS"):
        rotated.open(sealed, b"run-2")  # still bound to its run
    with pytest.raises(ValueError, match="differs"):
        new_only.open(sealed, b"run-1")
    resealed = rotated.reseal(sealed, b"run-1")
    assert resealed is not None and new_only.open(resealed, b"run-1") == b"private"
    assert rotated.reseal(resealed, b"run-1") is None  # already under the current key

    issued = JoinChallenges(SECRET_KEY, 60).issue("run-1", "t")
    assert JoinChallenges(KEY_B, 60, previous=SECRET_KEY).check(
        issued.text, run_id="run-1", token_id="t"
    )
    with pytest.raises(ChallengeRefused):
        JoinChallenges(KEY_B, 60).check(issued.text, run_id="run-1", token_id="t")


async def _works(app: FastAPI, run: dict[str, Any], invite: str, challenge: str | None) -> None:
    """A join (answering ``challenge``, issued elsewhere, if given), a certificate renewal and
    a revocation list signed by the run's authority, on ``app``."""
    async with client_for(app) as client:
        if challenge is None:
            peer = await Api(client).join(run["id"], invite)
        else:
            identity = Identity()
            body = {**join_proof(run["id"], challenge, identity), "addresses": ["ws://h:1"]}
            answer = await client.post(
                f"/api/v1/runs/{run['id']}/join", json=body, headers=bearer(invite)
            )
            assert answer.status_code == 200, answer.text
            peer = JoinedPeer(identity, answer.json())
        renew = await client.post(f"/api/v1/runs/{run['id']}/certificate", headers=peer.headers)
        assert renew.status_code == 200, renew.text
        signed = (await client.get(f"/api/v1/runs/{run['id']}/revocations")).json()
        book = RevocationBook(base64.urlsafe_b64decode(run["public_key"]), run["id"])
        assert book.offer(base64.urlsafe_b64decode(signed["list"])) is not None


async def test_rotating_the_secret_key_keeps_runs_working(settings: Settings) -> None:
    async with running(create_app(settings)) as old, client_for(old) as client:
        api = Api(client)
        run = await api.create_run()
        invite = (await api.create_join_token(run["id"]))["token"]
        pending = await client.post("/api/v1/join/challenge", headers=bearer(invite))
        challenge = pending.json()["challenge"]

    # The new key, with the old one as previous: runs and challenges of the old one work.
    during = make_settings(settings.database_url, secret_key=KEY_B, secret_key_previous=SECRET_KEY)
    async with running(create_app(during)) as app:
        await _works(app, run, invite, challenge)

    env = {
        "SWARMGRAD_ENVIRONMENT": "production",
        "SWARMGRAD_DATABASE_URL": settings.database_url,
        "SWARMGRAD_SECRET_KEY": KEY_B,
        "SWARMGRAD_SECRET_KEY_PREVIOUS": SECRET_KEY,
    }
    runner = CliRunner()
    first = runner.invoke(cli, ["rotate-key"], env=env)
    assert first.exit_code == 0, first.output
    assert first.stdout.strip() == "re-sealed 1 run key(s) under the current SWARMGRAD_SECRET_KEY"
    again = runner.invoke(cli, ["rotate-key"], env=env)
    assert again.exit_code == 0 and again.stdout.startswith("re-sealed 0 run key(s)")

    # The previous key is no longer needed; the old one alone no longer opens the run's key.
    after = make_settings(settings.database_url, secret_key=KEY_B)
    async with running(create_app(after)) as app:
        await _works(app, run, invite, None)
    wrong = runner.invoke(cli, ["rotate-key"], env={**env, "SWARMGRAD_SECRET_KEY": "c" * 40})
    assert wrong.exit_code == 1
    (line,) = wrong.stderr.strip().splitlines()
    assert line.startswith("error: nothing re-sealed: run ") and run["id"] in line
    engine = create_engine(settings.database_url)
    try:
        with engine.connect() as connection:
            sealed = connection.scalars(select(Run.authority_private_key_encrypted)).one()
    finally:
        engine.dispose()
    assert KeyBox(KEY_B).open(sealed, run["id"].encode())  # the failed rotation changed nothing


def test_organizer_tokens_from_the_command_line(
    settings: Settings, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    env = {
        "SWARMGRAD_ENVIRONMENT": "production",
        "SWARMGRAD_DATABASE_URL": settings.database_url,
        "SWARMGRAD_SECRET_KEY": SECRET_KEY,
    }
    runner = CliRunner()

    def run(*args: str) -> Any:
        return runner.invoke(cli, ["tokens", *args], env=env)

    empty = run("list")
    assert empty.exit_code == 0 and "no organizer tokens" in empty.stdout
    created = run("create", "--label", "ops laptop", "--expires-in", "30d")
    assert created.exit_code == 0, created.output
    plaintext = created.stdout.strip()
    assert plaintext.startswith("sgo_")
    token_id = _token_id(plaintext)

    listed = run("list")
    assert listed.exit_code == 0
    header, row = listed.stdout.strip().splitlines()
    assert header.split()[:3] == ["ID", "STATE", "CREATED"]
    assert row.startswith(f"{token_id}  active") and row.endswith("ops laptop")
    assert plaintext.split("_", 2)[2] not in listed.stdout  # the secret (it may hold "_")

    # The command line may revoke the last token: it can always make a new one.
    revoked = run("revoke", token_id)
    assert (
        revoked.exit_code == 0 and revoked.stdout.strip() == f"revoked organizer token {token_id}"
    )
    assert "revoked" in run("list").stdout.splitlines()[1]

    unknown = run("revoke", "0" * 16)
    assert unknown.exit_code == 1
    (line,) = unknown.stderr.strip().splitlines()
    assert line.startswith("error: no organizer token")
    # Through `swarmgrad`, as organizers type it: one line for a bad value.
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    with pytest.raises(SystemExit) as exited:
        main(["coordinator", "tokens", "create", "--expires-in", "soon"])
    assert exited.value.code == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("error: ") and "--expires-in" in line and "30m, 12h or 7d" in line
