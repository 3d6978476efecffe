"""A run's revocation list as the coordinator serves it: signed by the run's authority,
naming the banned volunteers' peers, with a serial that grows with each ban (SQLite and
PostgreSQL)."""

from __future__ import annotations

import base64
from datetime import timedelta
from typing import Any

import httpx
import pytest
from fastapi import FastAPI
from sqlalchemy import update

from peer.exceptions import AuthenticationError
from peer.formats.identity import Identity
from peer.formats.revocation import RevocationBook
from server.models import Volunteer, utcnow
from server.services.volunteers import redeem_invite
from tests.server.conftest import ORGANIZER, Api


async def _volunteer_with_peer(app: FastAPI, api: Api, run_id: str, name: str) -> tuple[int, Any]:
    invite = (await api.create_join_token(run_id))["token"]
    with app.state.session_factory() as session:
        redeemed = redeem_invite(session, invite, name, token_ttl_s=3600)
        session.commit()
        volunteer_id = redeemed.volunteer.id
    return volunteer_id, await api.join(run_id, redeemed.token)


async def _book(client: httpx.AsyncClient, run: dict[str, Any]) -> tuple[int, RevocationBook]:
    answer = (await client.get(f"/api/v1/runs/{run['id']}/revocations")).json()
    book = RevocationBook(base64.urlsafe_b64decode(run["public_key"]), run["id"])
    assert book.offer(base64.urlsafe_b64decode(answer["list"])) is not None
    return answer["serial"], book


async def _serial(client: httpx.AsyncClient, run_id: str) -> int:
    serial = (await client.get(f"/api/v1/runs/{run_id}")).json()["revocations_serial"]
    assert isinstance(serial, int)
    return serial


async def test_a_ban_puts_the_volunteers_peers_on_the_signed_list(
    app: FastAPI, client: httpx.AsyncClient, api: Api, run: dict[str, Any]
) -> None:
    assert await _serial(client, run["id"]) == 0
    serial, book = await _book(client, run)
    assert serial == 0 and book.current is not None and book.current.entries == ()

    mallory_id, mallory = await _volunteer_with_peer(app, api, run["id"], "mallory")
    _, honest = await _volunteer_with_peer(app, api, run["id"], "ada")
    ban = f"/api/v1/runs/{run['id']}/volunteers/{mallory_id}/ban"
    assert (await client.post(ban, headers=ORGANIZER)).status_code == 200

    first = await _serial(client, run["id"])
    serial, book = await _book(client, run)
    assert serial == first > 0
    now = utcnow().timestamp()
    assert book.revoked(mallory.identity.public_key, now)
    assert not book.revoked(honest.identity.public_key, now)
    # an entry lasts as long as a certificate issued before the ban can
    ttl = app.state.settings.certificate_ttl_s
    ((key, until),) = book.current.entries
    assert key == mallory.identity.public_key and now + ttl < until < now + ttl + 120

    # banning again changes nothing; another ban gives a higher serial
    assert (await client.post(ban, headers=ORGANIZER)).status_code == 200
    assert await _serial(client, run["id"]) == first
    eve_id, eve = await _volunteer_with_peer(app, api, run["id"], "eve")
    ban_eve = f"/api/v1/runs/{run['id']}/volunteers/{eve_id}/ban"
    assert (await client.post(ban_eve, headers=ORGANIZER)).status_code == 200
    second, newer = await _book(client, run)
    assert second > first and await _serial(client, run["id"]) == second
    assert newer.revoked(eve.identity.public_key, now) and newer.revoked(
        mallory.identity.public_key, now
    )


async def test_an_entry_leaves_the_list_once_its_certificates_are_dead(
    app: FastAPI, client: httpx.AsyncClient, api: Api, run: dict[str, Any]
) -> None:
    mallory_id, mallory = await _volunteer_with_peer(app, api, run["id"], "mallory")
    ban = f"/api/v1/runs/{run['id']}/volunteers/{mallory_id}/ban"
    assert (await client.post(ban, headers=ORGANIZER)).status_code == 200
    long_ago = utcnow() - timedelta(seconds=app.state.settings.certificate_ttl_s + 3600)
    with app.state.session_factory() as session:
        session.execute(
            update(Volunteer).where(Volunteer.id == mallory_id).values(banned_at=long_ago)
        )
        session.commit()
    serial, book = await _book(client, run)
    assert serial == int(long_ago.timestamp() * 1000)
    assert book.current is not None and book.current.entries == ()
    assert not book.revoked(mallory.identity.public_key, utcnow().timestamp())


async def test_the_list_is_signed_by_this_runs_authority_only(
    client: httpx.AsyncClient, api: Api, run: dict[str, Any]
) -> None:
    other = await api.create_run("other")
    answer = (await client.get(f"/api/v1/runs/{other['id']}/revocations")).json()
    data = base64.urlsafe_b64decode(answer["list"])
    mine = RevocationBook(base64.urlsafe_b64decode(run["public_key"]), run["id"])
    stranger = RevocationBook(Identity().public_key, other["id"])
    for book in (mine, stranger):
        with pytest.raises(AuthenticationError):
            book.offer(data)
