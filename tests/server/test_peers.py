"""Joining, bootstrap peers, certificate renewal."""

from __future__ import annotations

import base64
from typing import Any

import httpx
import pytest
from fastapi import FastAPI
from sqlalchemy import update

from peer.formats.identity import (
    Certificate,
    CertificateVerifier,
    Identity,
    peer_id_from_public_key,
)
from server.app import create_app
from server.clock import now_ms
from server.config import Settings
from server.models import Peer
from server.services import volunteers as volunteer_service
from tests.server.conftest import ORGANIZER, Api, b64, bearer, client_for, reached, running


async def test_join_returns_credentials_config_and_bootstrap(
    app: FastAPI, api: Api, run: dict[str, Any], join_token: str
) -> None:
    first = await api.join(
        run["id"], join_token, addresses=["ws://10.0.0.1:7000"], display_name="Ada"
    )
    body = first.body
    assert body["peer_id"] == peer_id_from_public_key(first.identity.public_key)
    assert body["run_id"] == run["id"]
    assert body["run_public_key"] == run["public_key"]
    assert body["config"] == run["config"] and body["task"] == run["task"]
    assert body["bootstrap"] == []
    assert body["peer_token"].startswith("sgp_")
    certificate = Certificate.from_base64(body["certificate"])
    assert certificate.role == "peer" and certificate.run_id == run["id"]
    assert body["report_interval_s"] == 10.0  # the default a public run wants

    # What a join claims is never handed out; what the probe reached is.
    assert (await api.join(run["id"], join_token)).body["bootstrap"] == []
    reached(app, first, "ws://10.0.0.2:7000")
    second = await api.join(run["id"], join_token)
    assert second.body["bootstrap"] == [
        {"peer_id": body["peer_id"], "addresses": ["ws://10.0.0.2:7000"]}
    ]


async def test_the_join_tells_the_coordinators_report_interval(settings: Settings) -> None:
    async with running(create_app(settings.model_copy(update={"report_interval_s": 2.0}))) as app:
        async with client_for(app) as client:
            api = Api(client)
            run = await api.create_run("interval")
            token = (await api.create_join_token(run["id"]))["token"]
            assert (await api.join(run["id"], token)).body["report_interval_s"] == 2.0


async def test_client_mode_peers_get_client_certificates_and_are_not_bootstrap(
    app: FastAPI, api: Api, client: httpx.AsyncClient, run: dict[str, Any], join_token: str
) -> None:
    behind_nat = await api.join(run["id"], join_token, addresses=[], client_mode=True)
    assert Certificate.from_base64(behind_nat.body["certificate"]).role == "client"
    server = await api.join(run["id"], join_token)
    reached(app, server, "ws://10.0.0.2:7000")
    assert server.body["bootstrap"] == []
    seen = await client.get(f"/api/v1/runs/{run['id']}/bootstrap", headers=behind_nat.headers)
    assert [p["peer_id"] for p in seen.json()["peers"]] == [server.body["peer_id"]]


async def test_bootstrap_is_a_sample_of_live_peers_never_the_caller(
    app: FastAPI, api: Api, client: httpx.AsyncClient, run: dict[str, Any], join_token: str
) -> None:
    peers = [await api.join(run["id"], join_token) for _ in range(12)]
    for i, p in enumerate(peers):
        reached(app, p, f"ws://10.0.0.{i + 1}:7000")
    ids = {p.body["peer_id"] for p in peers}
    stale = peers[0].body["peer_id"]
    with app.state.session_factory() as session, session.begin():
        session.execute(
            update(Peer).where(Peer.peer_id == stale).values(last_seen_ms=now_ms() - 3_600_000)
        )
    caller = peers[1]
    seen: set[str] = set()
    for _ in range(10):
        response = await client.get(f"/api/v1/runs/{run['id']}/bootstrap", headers=caller.headers)
        assert response.status_code == 200
        sample = [p["peer_id"] for p in response.json()["peers"]]
        assert len(sample) == len(set(sample)) == app.state.settings.bootstrap_peers
        assert caller.body["peer_id"] not in sample and stale not in sample
        seen.update(sample)
    # 10 samples of 8 among 10 candidates: the sample varies and covers everyone.
    assert seen == ids - {caller.body["peer_id"], stale}


async def test_a_paused_run_admits_peers_and_a_finished_one_refuses_them(
    api: Api, client: httpx.AsyncClient, run: dict[str, Any], join_token: str
) -> None:
    url = f"/api/v1/runs/{run['id']}"
    await client.patch(url, json={"status": "paused"}, headers=ORGANIZER)
    paused = await api.join(run["id"], join_token)
    assert paused.body["status"] == "paused"  # the peer waits until the run resumes
    renewed = await client.post(
        f"/api/v1/runs/{run['id']}/certificate", headers=bearer(paused.body["peer_token"])
    )
    assert renewed.status_code == 200, renewed.text  # a long pause costs no credentials
    await client.patch(url, json={"status": "running"}, headers=ORGANIZER)
    await api.join(run["id"], join_token)
    await client.patch(url, json={"status": "finished"}, headers=ORGANIZER)
    finished = await api.join(run["id"], join_token, expect=409)
    assert "finished" in finished.body["detail"]


async def test_refused_join_does_not_use_up_the_token(
    api: Api, client: httpx.AsyncClient, run: dict[str, Any]
) -> None:
    await api.join(run["id"], (await api.create_join_token(run["id"]))["token"], display_name="Ann")
    token = await api.create_join_token(run["id"], max_uses=1)
    taken = await api.join(run["id"], token["token"], display_name="ann", expect=409)
    assert "ann" in taken.body["detail"].lower()
    await api.join(run["id"], token["token"], display_name="Bea")


@pytest.mark.parametrize(
    "body",
    [
        {"public_key": "not base64!", "addresses": []},
        {"public_key": b64(b"short"), "addresses": []},
        {"public_key": b64(bytes(32)), "addresses": ["x" * 300]},
        {"public_key": b64(bytes(32)), "addresses": ["ws://a:1"] * 17},
        {"public_key": b64(bytes(32)), "display_name": "x" * 65},
        {"addresses": []},
    ],
)
async def test_invalid_join_bodies_are_422(
    client: httpx.AsyncClient, run: dict[str, Any], join_token: str, body: dict[str, Any]
) -> None:
    response = await client.post(
        f"/api/v1/runs/{run['id']}/join", json=body, headers=bearer(join_token)
    )
    assert response.status_code == 422, response.text
    assert response.json()["detail"][0]["msg"]


async def test_certificate_renewal(
    api: Api, client: httpx.AsyncClient, run: dict[str, Any], join_token: str
) -> None:
    peer = await api.join(run["id"], join_token)
    renewed = await client.post(f"/api/v1/runs/{run['id']}/certificate", headers=peer.headers)
    assert renewed.status_code == 200
    verify = CertificateVerifier(base64.urlsafe_b64decode(run["public_key"]), run["id"])
    cert = verify(
        Certificate.from_base64(renewed.json()["certificate"]).to_bytes(), peer.identity.public_key
    )
    assert cert.expires_at >= Certificate.from_base64(peer.body["certificate"]).expires_at


async def test_rejoin_keeps_the_probed_address_and_updates_the_display_name(
    app: FastAPI, api: Api, client: httpx.AsyncClient, run: dict[str, Any], join_token: str
) -> None:
    identity = Identity()
    first = await api.join(run["id"], join_token, identity, addresses=["ws://old:1"],
                           display_name="A")  # fmt: skip
    reached(app, first, "ws://10.0.0.2:7000")
    again = await api.join(
        run["id"], join_token, identity, addresses=["ws://new:2"], display_name="B"
    )
    other = await api.join(run["id"], join_token)
    sample = (await client.get(f"/api/v1/runs/{run['id']}/bootstrap", headers=other.headers)).json()
    probed = ["ws://10.0.0.2:7000"]
    assert sample["peers"] == [{"peer_id": again.body["peer_id"], "addresses": probed}]
    listed = (await client.get(f"/api/v1/runs/{run['id']}/peers", headers=ORGANIZER)).json()
    mine = next(p for p in listed["peers"] if p["peer_id"] == again.body["peer_id"])
    assert mine["display_name"] == "B" and mine["addresses"] == probed
    assert mine["online"] is True and mine["client_mode"] is False
    assert len(listed["peers"]) == 2


async def test_peer_listing_needs_an_organizer(
    api: Api, client: httpx.AsyncClient, run: dict[str, Any], join_token: str
) -> None:
    peer = await api.join(run["id"], join_token, display_name="Grace")
    url = f"/api/v1/runs/{run['id']}/peers"
    assert (await client.get(url)).status_code == 401
    assert (await client.get(url, headers=peer.headers)).status_code == 403
    listed = (await client.get(url, headers=ORGANIZER)).json()["peers"]
    assert [p["display_name"] for p in listed] == ["Grace"]
    assert listed[0]["samples"] == 0 and listed[0]["last_report_at"] is None


async def test_a_credential_joins_at_most_max_machines_keys_named_in_certificates(
    app: FastAPI, api: Api, caplog: pytest.LogCaptureFixture
) -> None:
    run = await api.create_run("capped", config={"max_machines": 2})
    invite = (await api.create_join_token(run["id"]))["token"]
    with app.state.session_factory() as session:
        redeemed = volunteer_service.redeem_invite(session, invite, "mallory", token_ttl_s=60)
        session.commit()
    first, second = [await api.join(run["id"], redeemed.token) for _ in range(2)]
    third = await api.join(run["id"], redeemed.token, expect=403)
    assert "max_machines" in third.body["detail"]
    assert any(f"volunteer {redeemed.volunteer.id}" in r.getMessage() for r in caplog.records)
    # The same keys come back (a restart), and certificates name the volunteer.
    again = await api.join(run["id"], redeemed.token, first.identity)
    names = {
        Certificate.from_base64(j.body["certificate"]).volunteer for j in (first, second, again)
    }
    assert names == {str(redeemed.volunteer.id)}
    stranger = await api.join(run["id"], invite)
    assert Certificate.from_base64(stranger.body["certificate"]).volunteer not in names
