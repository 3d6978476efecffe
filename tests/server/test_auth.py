"""Point 3: every protected endpoint refuses missing, wrong, expired, revoked, used-up and
wrong-scope tokens with the right status; tokens are stored hashed and never logged."""

from __future__ import annotations

import logging
from datetime import timedelta
from typing import Any

import httpx
import pytest
from fastapi import FastAPI
from sqlalchemy import select, update

from peer.formats.identity import Identity
from server.models import Token, TokenScope, utcnow
from server.security import hash_secret, mint_token, parse_token
from server.services import tokens as token_service
from tests.server.conftest import ORGANIZER, Api, JoinedPeer, bearer, join_proof

REPORT = {"epoch": 1, "samples": 10, "samples_per_second": 1.0}


class World:
    """Two runs, each with a join token and a joined peer, plus an organizer token."""

    def __init__(self, api: Api) -> None:
        self.api = api

    async def build(self) -> World:
        self.run = await self.api.create_run("a")
        self.other_run = await self.api.create_run("b")
        self.join = (await self.api.create_join_token(self.run["id"]))["token"]
        self.other_join = (await self.api.create_join_token(self.other_run["id"]))["token"]
        self.peer: JoinedPeer = await self.api.join(self.run["id"], self.join)
        self.other_peer: JoinedPeer = await self.api.join(self.other_run["id"], self.other_join)
        self.token_id = (await self.api.create_join_token(self.run["id"]))["id"]
        return self


CHECKPOINT = b"PK\x03\x04" + bytes(100)

# (name, scope needed, method, path template, body)
ENDPOINTS: list[tuple[str, str, str, str, dict[str, Any] | None]] = [
    ("create run", "organizer", "POST", "/api/v1/runs", {"name": "n", "task": "t"}),
    ("update run", "organizer", "PATCH", "/api/v1/runs/{run}", {"name": "renamed"}),
    ("archive run", "organizer", "DELETE", "/api/v1/runs/{run}", None),
    ("create token", "organizer", "POST", "/api/v1/runs/{run}/tokens", {}),
    ("list tokens", "organizer", "GET", "/api/v1/runs/{run}/tokens", None),
    ("revoke token", "organizer", "DELETE", "/api/v1/runs/{run}/tokens/{token_id}", None),
    ("list peers", "organizer", "GET", "/api/v1/runs/{run}/peers", None),
    ("list checkpoints", "organizer", "GET", "/api/v1/runs/{run}/checkpoints", None),
    ("join challenge", "join", "POST", "/api/v1/join/challenge", None),
    ("join", "join", "POST", "/api/v1/runs/{run}/join", None),
    ("bootstrap", "peer", "GET", "/api/v1/runs/{run}/bootstrap", None),
    ("certificate", "peer", "POST", "/api/v1/runs/{run}/certificate", None),
    ("report", "peer", "POST", "/api/v1/runs/{run}/reports", REPORT),
    ("reachability", "peer", "POST", "/api/v1/runs/{run}/reachability", {"port": 1}),
    ("upload checkpoint", "peer", "PUT", "/api/v1/runs/{run}/checkpoint?epoch=1", None),
]
SUCCESS = {"POST": {201, 200, 202}, "PATCH": {200}, "DELETE": {204}, "GET": {200}, "PUT": {201}}


async def _call(
    client: httpx.AsyncClient, world: World, endpoint: tuple[Any, ...], headers: dict[str, str]
) -> httpx.Response:
    name, _, method, template, body = endpoint
    path = template.format(run=world.run["id"], token_id=world.token_id)
    if name == "upload checkpoint":
        return await client.put(path, content=CHECKPOINT, headers=headers)
    if name == "join":  # a well-formed proof for the run and its invite
        answer = await client.post("/api/v1/join/challenge", headers=bearer(world.join))
        proof = join_proof(world.run["id"], answer.json()["challenge"], Identity())
        body = {**proof, "addresses": ["ws://127.0.0.1:1"]}
    return await client.request(method, path, json=body, headers=headers)


def _credentials(world: World) -> dict[str, str]:
    return {
        "organizer": ORGANIZER["Authorization"],
        "join": f"Bearer {world.join}",
        "peer": f"Bearer {world.peer.body['peer_token']}",
    }


@pytest.fixture
async def world(api: Api) -> World:
    return await World(api).build()


@pytest.mark.parametrize("endpoint", ENDPOINTS, ids=[e[0] for e in ENDPOINTS])
async def test_missing_malformed_and_wrong_tokens_are_401(
    client: httpx.AsyncClient, world: World, endpoint: tuple[Any, ...]
) -> None:
    scope = endpoint[1]
    good = _credentials(world)[scope].removeprefix("Bearer ")
    parsed = parse_token(good)
    wrong_secret = good[:-4] + ("AAAA" if not good.endswith("AAAA") else "BBBB")
    unknown_id = f"sg{good[2]}_{'0' * 16}_{parsed.secret}" if parsed else "sgo_0000000000000000_x"
    cases: list[dict[str, str]] = [
        {},
        {"Authorization": "Basic dXNlcjpwdw=="},
        {"Authorization": "Bearer"},
        {"Authorization": "Bearer not-a-token"},
        bearer(wrong_secret),
        bearer(unknown_id),
    ]
    for headers in cases:
        response = await _call(client, world, endpoint, headers)
        assert response.status_code == 401, (headers, response.text)
        assert response.headers["WWW-Authenticate"] == "Bearer"
        assert isinstance(response.json()["detail"], str) and response.json()["detail"]


@pytest.mark.parametrize("endpoint", ENDPOINTS, ids=[e[0] for e in ENDPOINTS])
async def test_wrong_scope_is_403_and_right_scope_succeeds(
    client: httpx.AsyncClient, world: World, endpoint: tuple[Any, ...]
) -> None:
    needed = endpoint[1]
    for scope, authorization in _credentials(world).items():
        if scope == needed:
            continue
        response = await _call(client, world, endpoint, {"Authorization": authorization})
        assert response.status_code == 403, (scope, response.text)
        assert f"needs a {needed} token" in response.json()["detail"]
    response = await _call(client, world, endpoint, {"Authorization": _credentials(world)[needed]})
    assert response.status_code in SUCCESS[endpoint[2]], response.text


@pytest.mark.parametrize(
    "endpoint",
    # The join challenge is for the token's own run: there is no other run to name.
    [e for e in ENDPOINTS if e[1] != "organizer" and e[0] != "join challenge"],
    ids=lambda e: e[0],
)
async def test_token_of_another_run_is_403(
    client: httpx.AsyncClient, world: World, endpoint: tuple[Any, ...]
) -> None:
    other = world.other_join if endpoint[1] == "join" else world.other_peer.body["peer_token"]
    response = await _call(client, world, endpoint, bearer(other))
    assert response.status_code == 403
    assert "another run" in response.json()["detail"]


async def _expire(app: FastAPI, token_id: str) -> None:
    with app.state.session_factory() as session, session.begin():
        session.execute(
            update(Token)
            .where(Token.id == token_id)
            .values(expires_at=utcnow() - timedelta(seconds=1))
        )


async def test_expired_join_token_is_401(app: FastAPI, api: Api, world: World) -> None:
    created = await api.create_join_token(world.run["id"], expires_in_s=3600)
    await _expire(app, created["id"])
    peer = await api.join(world.run["id"], created["token"], expect=401)
    assert "expired" in peer.body["detail"] and "new invite" in peer.body["detail"]


async def test_revoked_join_token_is_401(api: Api, client: httpx.AsyncClient, world: World) -> None:
    created = await api.create_join_token(world.run["id"])
    revoked = await client.delete(
        f"/api/v1/runs/{world.run['id']}/tokens/{created['id']}", headers=ORGANIZER
    )
    assert revoked.status_code == 204
    peer = await api.join(world.run["id"], created["token"], expect=401)
    assert "revoked" in peer.body["detail"]
    listed = (await client.get(f"/api/v1/runs/{world.run['id']}/tokens", headers=ORGANIZER)).json()
    entry = next(t for t in listed["tokens"] if t["id"] == created["id"])
    assert entry["active"] is False and entry["revoked_at"] is not None
    assert "token" not in entry  # the secret is never listed


async def test_used_up_join_token_is_401(api: Api, client: httpx.AsyncClient, world: World) -> None:
    created = await api.create_join_token(world.run["id"], max_uses=2)
    await api.join(world.run["id"], created["token"])
    await api.join(world.run["id"], created["token"])
    third = await api.join(world.run["id"], created["token"], expect=401)
    assert "maximum of 2" in third.body["detail"]
    listed = (await client.get(f"/api/v1/runs/{world.run['id']}/tokens", headers=ORGANIZER)).json()
    entry = next(t for t in listed["tokens"] if t["id"] == created["id"])
    assert entry["uses"] == 2 and entry["active"] is False


async def test_rejoining_revokes_the_old_peer_token(api: Api, world: World) -> None:
    again = await api.join(world.run["id"], world.join, world.peer.identity)
    assert again.body["peer_id"] == world.peer.body["peer_id"]
    old = await api.report(world.run["id"], world.peer, **REPORT)
    assert old.status_code == 401 and "revoked" in old.json()["detail"]
    new = await api.report(world.run["id"], again, **REPORT)
    assert new.status_code == 202


async def test_organizer_tokens_from_the_database(app: FastAPI, client: httpx.AsyncClient) -> None:
    with app.state.session_factory() as session, session.begin():
        token, plaintext = token_service.create_organizer_token(session, label="ci")
        token_id = token.id
    created = await client.post(
        "/api/v1/runs", json={"name": "n", "task": "t"}, headers=bearer(plaintext)
    )
    assert created.status_code == 201
    with app.state.session_factory() as session, session.begin():
        token_service.revoke(session, session.get(Token, token_id))
    refused = await client.post(
        "/api/v1/runs", json={"name": "n", "task": "t"}, headers=bearer(plaintext)
    )
    assert refused.status_code == 401 and "revoked" in refused.json()["detail"]


async def test_tokens_are_stored_only_as_hashes(app: FastAPI, api: Api, world: World) -> None:
    plaintexts = [world.join, world.other_join, world.peer.body["peer_token"]]
    with app.state.session_factory() as session:
        rows = session.scalars(select(Token)).all()
        assert {r.scope for r in rows} == {TokenScope.join, TokenScope.peer}
        dumped = repr([(r.id, r.secret_hash, r.label) for r in rows])
    for plaintext in plaintexts:
        parsed = parse_token(plaintext)
        assert parsed is not None
        assert parsed.secret not in dumped
        stored = next(r for r in rows if r.id == parsed.id)
        assert stored.secret_hash == hash_secret(parsed.secret) != parsed.secret.encode()


async def test_tokens_never_reach_the_logs(
    caplog: pytest.LogCaptureFixture, api: Api, client: httpx.AsyncClient
) -> None:
    caplog.set_level(logging.DEBUG)
    run = await api.create_run()
    join = await api.create_join_token(run["id"])
    peer = await api.join(run["id"], join["token"])
    await api.report(run["id"], peer, **REPORT)
    await client.get(f"/api/v1/runs/{run['id']}/bootstrap", headers=peer.headers)
    await client.post("/api/v1/runs", headers=bearer(join["token"] + "x"), json={})
    secrets_seen = [join["token"], peer.body["peer_token"], ORGANIZER["Authorization"][7:]]
    logged = "\n".join(r.getMessage() + repr(r.args) for r in caplog.records)
    assert caplog.records  # SQLAlchemy/httpx did log something at DEBUG
    for secret in secrets_seen:
        assert parse_token(secret) is None or parse_token(secret).secret not in logged
        assert secret not in logged


def test_token_format_round_trips() -> None:
    for scope in TokenScope:
        new = mint_token(scope)
        parsed = parse_token(new.plaintext)
        assert parsed is not None and parsed.scope is scope and parsed.id == new.id
        assert hash_secret(parsed.secret) == new.secret_hash
    assert parse_token("sgx_0123456789abcdef_secret") is None
    assert parse_token("sgo_short_secret") is None
    assert parse_token("") is None
