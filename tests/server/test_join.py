"""Joining with proof of possession: a join names a public key and carries that key's
signature over a challenge bound to the run and the invite, so an invite alone cannot take
over another peer's identity."""

from __future__ import annotations

from typing import Any

import httpx
import msgpack
import pytest
from fastapi import FastAPI
from sqlalchemy import select

from peer.formats.identity import JOIN_PROOF_CONTEXT, Identity, join_proof_payload
from server.clock import now_ms
from server.models import Peer, Token
from server.security import JoinChallenges
from tests.server.conftest import ORGANIZER, SECRET_KEY, Api, b64, bearer, join_proof, reached

CHALLENGE = "/api/v1/join/challenge"


def join_url(run_id: str) -> str:
    return f"/api/v1/runs/{run_id}/join"


async def challenge_for(client: httpx.AsyncClient, join_token: str) -> str:
    response = await client.post(CHALLENGE, headers=bearer(join_token))
    assert response.status_code == 200, response.text
    return response.json()["challenge"]


def snapshot(app: FastAPI, peer_id: str) -> tuple[Any, ...]:
    """Everything a hijack would change about a peer: its row and its tokens."""
    with app.state.session_factory() as session:
        peer = session.scalars(select(Peer).where(Peer.peer_id == peer_id)).one()
        tokens = session.scalars(select(Token).where(Token.peer_id == peer.id)).all()
        return (
            peer.id,
            list(peer.addresses),
            peer.client_mode,
            peer.volunteer.display_name,
            sorted((t.id, t.revoked_at) for t in tokens),
        )


def test_join_proof_payload_binds_run_challenge_and_key() -> None:
    key = Identity().public_key
    payload = join_proof_payload("run1", "c.h", key)
    assert payload.startswith(JOIN_PROOF_CONTEXT)
    assert msgpack.unpackb(payload[len(JOIN_PROOF_CONTEXT) :]) == ["run1", "c.h", key]
    assert join_proof_payload("run1", "c.h", bytearray(key)) == payload
    others = {
        join_proof_payload("run2", "c.h", key),
        join_proof_payload("run1", "c.i", key),
        join_proof_payload("run1", "c.h", Identity().public_key),
    }
    assert payload not in others and len(others) == 3


async def test_challenge_names_the_token_s_run(
    client: httpx.AsyncClient, run: dict[str, Any], join_token: str
) -> None:
    response = await client.post(CHALLENGE, headers=bearer(join_token))
    assert response.status_code == 200
    body = response.json()
    assert set(body) == {"run_id", "run_name", "task", "status", "challenge", "expires_at"}
    assert (body["run_id"], body["run_name"], body["task"], body["status"]) == (
        run["id"],
        run["name"],
        run["task"],
        "running",
    )
    assert body["challenge"] != await challenge_for(client, join_token)  # fresh every time


async def test_challenge_needs_a_valid_join_token_of_an_open_run(
    api: Api, client: httpx.AsyncClient, run: dict[str, Any], join_token: str
) -> None:
    assert (await client.post(CHALLENGE)).status_code == 401
    assert (await client.post(CHALLENGE, headers=ORGANIZER)).status_code == 403
    revoked = await api.create_join_token(run["id"])
    await client.delete(f"/api/v1/runs/{run['id']}/tokens/{revoked['id']}", headers=ORGANIZER)
    refused = await client.post(CHALLENGE, headers=bearer(revoked["token"]))
    assert refused.status_code == 401 and "revoked" in refused.json()["detail"]
    await client.patch(f"/api/v1/runs/{run['id']}", json={"status": "paused"}, headers=ORGANIZER)
    paused = await client.post(CHALLENGE, headers=bearer(join_token))
    assert paused.status_code == 200 and paused.json()["status"] == "paused"
    await client.patch(f"/api/v1/runs/{run['id']}", json={"status": "finished"}, headers=ORGANIZER)
    finished = await client.post(CHALLENGE, headers=bearer(join_token))
    assert finished.status_code == 409 and "finished" in finished.json()["detail"]


async def test_a_key_without_its_private_half_is_refused_and_the_victim_untouched(
    app: FastAPI, api: Api, client: httpx.AsyncClient, run: dict[str, Any], join_token: str
) -> None:
    victim = await api.join(run["id"], join_token, addresses=["ws://10.0.0.1:7000"])
    reached(app, victim, "ws://10.0.0.1:7000")
    before = snapshot(app, victim.body["peer_id"])
    attacker = Identity()
    challenge = await challenge_for(client, join_token)
    # The attacker knows the victim's public key (peers announce it) but can only sign with
    # its own key: over the victim's key, or with a made-up signature.
    forged = [
        attacker.sign(join_proof_payload(run["id"], challenge, victim.identity.public_key)),
        bytes(64),
    ]
    for signature in forged:
        response = await client.post(
            join_url(run["id"]),
            json={
                "public_key": b64(victim.identity.public_key),
                "challenge": challenge,
                "signature": b64(signature),
                "addresses": ["ws://6.6.6.6:1"],
                "display_name": "mallory",
            },
            headers=bearer(join_token),
        )
        assert response.status_code == 403, response.text
        assert "private key" in response.json()["detail"]
    assert snapshot(app, victim.body["peer_id"]) == before
    # The victim's peer token still works, and other peers are still given its address.
    assert (await api.report(run["id"], victim, samples=1)).status_code == 202
    sample = await client.get(
        f"/api/v1/runs/{run['id']}/bootstrap",
        headers=(await api.join(run["id"], join_token)).headers,
    )
    assert sample.json()["peers"][0]["addresses"] == ["ws://10.0.0.1:7000"]


async def test_a_challenge_works_only_for_its_run_and_invite(
    api: Api, client: httpx.AsyncClient, run: dict[str, Any], join_token: str
) -> None:
    identity = Identity()
    other_invite = (await api.create_join_token(run["id"]))["token"]
    other_run = await api.create_run("other")
    other_run_invite = (await api.create_join_token(other_run["id"]))["token"]
    challenge = await challenge_for(client, join_token)
    # Replayed with another invite of the same run, and with an invite of another run.
    for run_id, token in ((run["id"], other_invite), (other_run["id"], other_run_invite)):
        response = await client.post(
            join_url(run_id),
            json={**join_proof(run_id, challenge, identity), "addresses": []},
            headers=bearer(token),
        )
        assert response.status_code == 403, response.text
        assert "another run or invite" in response.json()["detail"]
        assert "POST /api/v1/join/challenge" in response.json()["detail"]
    # A signature over another run id does not carry over either.
    signed_elsewhere = join_proof(other_run["id"], challenge, identity)
    response = await client.post(
        join_url(run["id"]),
        json={**signed_elsewhere, "addresses": []},
        headers=bearer(join_token),
    )
    assert response.status_code == 403
    # Made up, or tampered with.
    body, _, tag = challenge.partition(".")

    def flip(text: str) -> str:  # the first character carries six bits of data
        return ("B" if text[0] == "A" else "A") + text[1:]

    for bogus in (f"{body}.{flip(tag)}", f"{flip(body)}.{tag}", "bm90.aGluZw"):
        response = await client.post(
            join_url(run["id"]),
            json={**join_proof(run["id"], bogus, identity), "addresses": []},
            headers=bearer(join_token),
        )
        assert response.status_code == 403, bogus
        assert "not one this coordinator issued" in response.json()["detail"]
    # The genuine one still works.
    response = await client.post(
        join_url(run["id"]),
        json={**join_proof(run["id"], challenge, identity), "addresses": []},
        headers=bearer(join_token),
    )
    assert response.status_code == 200, response.text


async def test_an_expired_challenge_is_refused(
    app: FastAPI, client: httpx.AsyncClient, run: dict[str, Any], join_token: str
) -> None:
    token_id = join_token.split("_")[1]
    ttl_s = app.state.settings.join_challenge_ttl_s
    issued_long_ago = JoinChallenges(SECRET_KEY, ttl_s, clock=lambda: now_ms() - 1000 * ttl_s - 1)
    challenge = issued_long_ago.issue(run["id"], token_id).text
    response = await client.post(
        join_url(run["id"]),
        json={**join_proof(run["id"], challenge, Identity()), "addresses": []},
        headers=bearer(join_token),
    )
    assert response.status_code == 403
    assert "expired" in response.json()["detail"]
    # Signed with another secret: not ours, whatever it says.
    foreign = JoinChallenges("another-secret-" + "x" * 40, ttl_s).issue(run["id"], token_id).text
    response = await client.post(
        join_url(run["id"]),
        json={**join_proof(run["id"], foreign, Identity()), "addresses": []},
        headers=bearer(join_token),
    )
    assert response.status_code == 403


async def test_rejoining_with_the_same_key_uses_up_nothing(
    api: Api, client: httpx.AsyncClient, run: dict[str, Any]
) -> None:
    invite = await api.create_join_token(run["id"], max_uses=1)
    identity = Identity()
    first = await api.join(run["id"], invite["token"], identity, addresses=["ws://h:1"])
    # The invite is used up for new keys, but its holder can come back with the same key
    # (a restart), as often as needed.
    for port in (2, 3):
        again = await api.join(run["id"], invite["token"], identity, addresses=[f"ws://h:{port}"])
        assert again.body["peer_id"] == first.body["peer_id"]
        assert again.body["peer_token"] != first.body["peer_token"]
    tokens = (await client.get(f"/api/v1/runs/{run['id']}/tokens", headers=ORGANIZER)).json()
    assert [t["uses"] for t in tokens["tokens"] if t["id"] == invite["id"]] == [1]
    newcomer = await api.join(run["id"], invite["token"], expect=401)
    assert "maximum of 1" in newcomer.body["detail"]
    assert "new invite" in newcomer.body["detail"]


async def test_rejoining_needs_an_unrevoked_invite(
    api: Api, client: httpx.AsyncClient, run: dict[str, Any]
) -> None:
    invite = await api.create_join_token(run["id"], max_uses=1)
    identity = Identity()
    await api.join(run["id"], invite["token"], identity)
    challenge = await challenge_for(client, invite["token"])
    await client.delete(f"/api/v1/runs/{run['id']}/tokens/{invite['id']}", headers=ORGANIZER)
    response = await client.post(
        join_url(run["id"]),
        json={**join_proof(run["id"], challenge, identity), "addresses": []},
        headers=bearer(invite["token"]),
    )
    assert response.status_code == 401 and "revoked" in response.json()["detail"]


async def test_join_refused_when_the_run_finishes_after_the_challenge(
    client: httpx.AsyncClient, run: dict[str, Any], join_token: str
) -> None:
    challenge = await challenge_for(client, join_token)
    await client.patch(f"/api/v1/runs/{run['id']}", json={"status": "finished"}, headers=ORGANIZER)
    response = await client.post(
        join_url(run["id"]),
        json={**join_proof(run["id"], challenge, Identity()), "addresses": []},
        headers=bearer(join_token),
    )
    assert response.status_code == 409 and "finished" in response.json()["detail"]


async def test_join_answer_names_the_run_and_its_checkpoint(
    api: Api, run: dict[str, Any], join_token: str
) -> None:
    joined = await api.join(run["id"], join_token)
    assert joined.body["run_name"] == run["name"]
    assert joined.body["status"] == "running"
    assert joined.body["checkpoint"] is None  # see test_checkpoints.py for one


@pytest.mark.parametrize(
    "change",
    [
        {"challenge": None},
        {"signature": None},
        {"signature": "not base64!"},
        {"signature": b64(bytes(32))},
        {"challenge": "no-dot"},
        {"challenge": "a." + "b" * 300},
    ],
    ids=[
        "no challenge",
        "no signature",
        "signature not base64",
        "short signature",
        "challenge without a tag",
        "long challenge",
    ],
)
async def test_malformed_proofs_are_422(
    client: httpx.AsyncClient, run: dict[str, Any], join_token: str, change: dict[str, Any]
) -> None:
    body: dict[str, Any] = {
        **join_proof(run["id"], await challenge_for(client, join_token), Identity()),
        "addresses": [],
    }
    for key, value in change.items():
        if value is None:
            del body[key]
        else:
            body[key] = value
    response = await client.post(join_url(run["id"]), json=body, headers=bearer(join_token))
    assert response.status_code == 422, response.text
