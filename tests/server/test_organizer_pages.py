"""The organizer's pages: CSRF tokens bound to the session, the ban's offer to revoke the
invites a volunteer came through, and the checkpoint section."""

from __future__ import annotations

import re
from typing import Any

import httpx
from fastapi import FastAPI

from server.config import Settings
from server.services import volunteers as volunteer_service
from server.web.security import CSRF_COOKIE, ORGANIZER_COOKIE, csrf_cookie_name, csrf_token
from tests.server.conftest import (
    ADMIN_TOKEN,
    ORGANIZER,
    SECRET_KEY,
    Api,
    client_for,
    make_settings,
    running,
)

CSRF = re.compile(r'name="csrf" value="([^"]+)"')


async def signed_in(client: httpx.AsyncClient) -> str:
    """Sign in; the CSRF field of the pages that follow."""
    page = await client.get("/signin")
    found = CSRF.search(page.text)
    assert found
    answer = await client.post("/signin", data={"csrf": found.group(1), "token": ADMIN_TOKEN})
    assert answer.status_code == 303
    again = CSRF.search((await client.get("/")).text)
    assert again
    return again.group(1)


async def test_the_csrf_field_is_an_hmac_of_the_session(
    client: httpx.AsyncClient, run: dict[str, Any]
) -> None:
    field = await signed_in(client)
    assert field == csrf_token(SECRET_KEY, client.cookies[ORGANIZER_COOKIE])
    pause = f"/runs/{run['id']}/actions/pause"
    # A cookie and a field both chosen by an attacker (the old double submit) do not pass.
    client.cookies.set(CSRF_COOKIE, "chosen")
    for forged in ("chosen", csrf_token("another key", client.cookies[ORGANIZER_COOKIE])):
        answer = await client.post(pause, data={"csrf": forged})
        assert answer.status_code == 403
    # Nor does the field of another session (the attacker's own, signed-out one).
    answer = await client.post(pause, data={"csrf": csrf_token(SECRET_KEY, "chosen")})
    assert answer.status_code == 403
    assert (await client.get(f"/api/v1/runs/{run['id']}")).json()["status"] == "running"
    assert (await client.post(pause, data={"csrf": field})).status_code == 303
    assert (await client.get(f"/api/v1/runs/{run['id']}")).json()["status"] == "paused"


async def test_over_https_the_session_cookie_is_host_prefixed(
    database_url: str, tmp_path: Any
) -> None:
    settings = make_settings(
        database_url, public_url="https://coord.example", checkpoint_dir=tmp_path / "c"
    )
    async with running(_app(settings)) as app, client_for(app) as client:
        page = await client.get("/signin")
        cookie = next(h for h in page.headers.get_list("set-cookie") if "csrf" in h)
        assert cookie.startswith(csrf_cookie_name(True) + "=")
        assert "Secure" in cookie and "Path=/" in cookie and "Domain" not in cookie
        session = cookie.split(";")[0].split("=", 1)[1]
        assert CSRF.search(page.text).group(1) == csrf_token(SECRET_KEY, session)  # type: ignore[union-attr]


def _app(settings: Settings) -> FastAPI:
    from server.app import create_app

    return create_app(settings)


async def test_a_ban_offers_to_revoke_the_invites_the_volunteer_came_through(
    app: FastAPI, api: Api, client: httpx.AsyncClient, run: dict[str, Any], join_token: str
) -> None:
    with app.state.session_factory() as session:
        redeemed = volunteer_service.redeem_invite(session, join_token, "mallory", token_ttl_s=60)
        session.commit()
    await api.join(run["id"], redeemed.token)
    field = await signed_in(client)
    ban = f"/runs/{run['id']}/volunteers/{redeemed.volunteer.id}/ban"
    answer = await client.post(ban, data={"csrf": field})
    assert answer.status_code == 303
    page = await client.get(answer.headers["location"])
    offer = re.search(r'<div id="ban-offer".*?</div>', page.text, re.S)
    assert offer and "mallory" in offer.group(0) and "Revoke invite lab" in offer.group(0)
    invite_id = join_token.split("_")[1]
    assert f"/invites/{invite_id}/revoke" in offer.group(0)
    # The banned person comes back through the invite with a new key, until it is revoked.
    assert (await api.join(run["id"], join_token)).body["peer_id"]
    revoke = await client.post(f"/runs/{run['id']}/invites/{invite_id}/revoke",
                               data={"csrf": field})  # fmt: skip
    assert revoke.status_code == 303
    refused = await api.join(run["id"], join_token, expect=401)
    assert "revoked" in refused.body["detail"]


async def test_the_ban_api_names_and_revokes_the_invites(
    api: Api, client: httpx.AsyncClient, run: dict[str, Any], join_token: str
) -> None:
    peer = await api.join(run["id"], join_token)
    listed = (await client.get(f"/api/v1/runs/{run['id']}/dashboard")).json()["volunteers"]
    volunteer_id = next(v["id"] for v in listed)
    ban = f"/api/v1/runs/{run['id']}/volunteers/{volunteer_id}/ban"
    first = (await client.post(ban, headers=ORGANIZER)).json()
    invite_id = join_token.split("_")[1]
    assert first["invites"] == [invite_id] and first["invites_revoked"] == []
    assert (await api.join(run["id"], join_token)).body["peer_id"] != peer.body["peer_id"]
    second = (await client.post(ban + "?revoke_invites=true", headers=ORGANIZER)).json()
    assert second["invites_revoked"] == [invite_id]
    assert "revoked" in (await api.join(run["id"], join_token, expect=401)).body["detail"]


async def test_the_run_page_lists_pins_and_deletes_checkpoints(
    api: Api, client: httpx.AsyncClient, run: dict[str, Any], join_token: str
) -> None:
    peer = await api.join(run["id"], join_token)
    for epoch in (1, 2):
        answer = await client.put(
            f"/api/v1/runs/{run['id']}/checkpoint?epoch={epoch}",
            content=b"PK\x03\x04" + bytes([epoch]) * 10,
            headers={**peer.headers, "Content-Type": "application/octet-stream"},
        )
        assert answer.status_code == 201
    field = await signed_in(client)
    page = (await client.get(f"/runs/{run['id']}")).text
    assert 'data-epoch="2"' in page and 'data-epoch="1"' in page
    pinned = await client.post(f"/runs/{run['id']}/checkpoints/1/pin", data={"csrf": field})
    assert pinned.status_code == 303
    served = await client.get(f"/api/v1/runs/{run['id']}/checkpoint", headers=ORGANIZER)
    assert served.headers["X-Checkpoint-Epoch"] == "1"
    assert ">pinned<" in (await client.get(f"/runs/{run['id']}")).text
    gone = await client.post(f"/runs/{run['id']}/checkpoints/2/delete", data={"csrf": field})
    assert gone.status_code == 303
    assert 'data-epoch="2"' not in (await client.get(f"/runs/{run['id']}")).text
    forged = await client.post(f"/runs/{run['id']}/checkpoints/1/delete", data={"csrf": "x"})
    assert forged.status_code == 403
