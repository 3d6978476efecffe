"""The coordinator probes a peer's ports from the outside, at the address the request came
from, and announces the peer (or not) accordingly; once per interval per peer."""

from __future__ import annotations

import re
import socket
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from typing import Any

import httpx
import pytest
from fastapi import FastAPI
from starlette.types import ASGIApp
from uvicorn.middleware.proxy_headers import ProxyHeadersMiddleware

from server.app import create_app
from server.config import Settings
from tests.server.conftest import ORGANIZER, Api, JoinedPeer, make_settings, running


@pytest.fixture
def listening() -> Iterator[list[int]]:
    """Two ports on 127.0.0.1 that accept connections (the kernel completes the handshake
    from the listen backlog; nobody needs to accept)."""
    sockets = []
    for _ in range(2):
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        s.listen(8)
        sockets.append(s)
    yield [s.getsockname()[1] for s in sockets]
    for s in sockets:
        s.close()


@pytest.fixture
def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@asynccontextmanager
async def client_from(app: ASGIApp, host: str) -> AsyncIterator[httpx.AsyncClient]:
    transport = httpx.ASGITransport(app=app, client=(host, 123))
    async with httpx.AsyncClient(transport=transport, base_url="http://coordinator") as client:
        yield client


async def probe(
    client: httpx.AsyncClient, run_id: str, peer: JoinedPeer, **body: Any
) -> httpx.Response:
    return await client.post(f"/api/v1/runs/{run_id}/reachability", json=body, headers=peer.headers)


async def listed(client: httpx.AsyncClient, run_id: str, peer: JoinedPeer) -> dict[str, Any]:
    peers = (await client.get(f"/api/v1/runs/{run_id}/peers", headers=ORGANIZER)).json()["peers"]
    return next(p for p in peers if p["peer_id"] == peer.body["peer_id"])


@pytest.fixture
def settings(database_url: str) -> Settings:
    return make_settings(database_url, reachability_interval_s=0)


async def test_a_listening_peer_is_reachable_and_announced(
    app: FastAPI, listening: list[int]
) -> None:
    async with client_from(app, "127.0.0.1") as client:
        api = Api(client)
        run = await api.create_run()
        token = (await api.create_join_token(run["id"]))["token"]
        peer = await api.join(run["id"], token, addresses=[], client_mode=True)
        port, bulk_port = listening
        response = await probe(client, run["id"], peer, port=port, bulk_port=bulk_port)
        assert response.status_code == 200, response.text
        assert response.json() == {
            "reachable": True,
            "address": f"ws://127.0.0.1:{port}",
            "host": "127.0.0.1",
            "port": port,
            "bulk_port": bulk_port,
            "detail": f"reachable at ws://127.0.0.1:{port} (bulk port {bulk_port} too)",
            "punch_address": None,
        }
        mine = await listed(client, run["id"], peer)
        assert mine["addresses"] == [f"ws://127.0.0.1:{port}"] and mine["client_mode"] is False
        other = await api.join(run["id"], token)
        sample = await client.get(f"/api/v1/runs/{run['id']}/bootstrap", headers=other.headers)
        assert sample.json()["peers"] == [
            {"peer_id": peer.body["peer_id"], "addresses": [f"ws://127.0.0.1:{port}"]}
        ]


async def test_a_closed_port_makes_the_peer_a_client(
    app: FastAPI, listening: list[int], closed_port: int
) -> None:
    async with client_from(app, "127.0.0.1") as client:
        api = Api(client)
        run = await api.create_run()
        token = (await api.create_join_token(run["id"]))["token"]
        peer = await api.join(run["id"], token, addresses=["ws://192.0.2.1:9"])
        for port, bulk_port in ((closed_port, None), (listening[0], closed_port)):
            response = await probe(client, run["id"], peer, port=port, bulk_port=bulk_port)
            assert response.status_code == 200, response.text
            body = response.json()
            assert body["reachable"] is False and body["address"] is None
            assert body["host"] == "127.0.0.1" and body["bulk_port"] == bulk_port
            assert f"port {closed_port} connection refused" in body["detail"]
            assert "client mode" in body["detail"]
            mine = await listed(client, run["id"], peer)
            assert mine["addresses"] == [] and mine["client_mode"] is True
        other = await api.join(run["id"], token)
        sample = await client.get(f"/api/v1/runs/{run['id']}/bootstrap", headers=other.headers)
        assert sample.json()["peers"] == []


async def test_the_probed_host_is_the_client_address(app: FastAPI, listening: list[int]) -> None:
    """Not something the peer says: a request from 127.0.0.2 probes 127.0.0.2, where nothing
    listens; behind a proxy, uvicorn's proxy-headers middleware (on in `swarmgrad
    coordinator`) sets the client address from X-Forwarded-For."""
    async with client_from(app, "127.0.0.1") as client:
        api = Api(client)
        run = await api.create_run()
        peer = await api.join(run["id"], (await api.create_join_token(run["id"]))["token"])
    async with client_from(app, "127.0.0.2") as client:
        body = (await probe(client, run["id"], peer, port=listening[0])).json()
        assert body["host"] == "127.0.0.2" and body["reachable"] is False
    proxied = ProxyHeadersMiddleware(app, trusted_hosts="127.0.0.1")
    async with client_from(proxied, "127.0.0.1") as client:
        forwarded = {**peer.headers, "X-Forwarded-For": "127.0.0.2"}
        response = await client.post(
            f"/api/v1/runs/{run['id']}/reachability",
            json={"port": listening[0]},
            headers=forwarded,
        )
        assert response.json()["host"] == "127.0.0.2"
    async with client_from(app, "testclient") as client:
        body = (await probe(client, run["id"], peer, port=listening[0])).json()
        assert body["reachable"] is False and "not an IP address" in body["detail"]


async def test_one_probe_per_interval_across_workers(
    database_url: str, listening: list[int]
) -> None:
    settings = make_settings(database_url, reachability_interval_s=3600)
    # Two apps on one database stand for two workers.
    async with running(create_app(settings)) as first, running(create_app(settings)) as second:
        async with client_from(first, "127.0.0.1") as client:
            api = Api(client)
            run = await api.create_run()
            peer = await api.join(run["id"], (await api.create_join_token(run["id"]))["token"])
            assert (await probe(client, run["id"], peer, port=listening[0])).status_code == 200
            again = await probe(client, run["id"], peer, port=listening[0])
        assert again.status_code == 429
        assert 3590 <= int(again.headers["Retry-After"]) <= 3600
        assert "try again in" in again.json()["detail"]
        async with client_from(second, "127.0.0.1") as client:
            elsewhere = await probe(client, run["id"], peer, port=listening[0])
        assert elsewhere.status_code == 429
        assert elsewhere.headers["X-Swarmgrad-Coordinator"] == "1"


@pytest.mark.parametrize("body", [{}, {"port": 0}, {"port": 65536}, {"port": 1, "bulk_port": 0}])
async def test_invalid_ports_are_422(app: FastAPI, body: dict[str, Any]) -> None:
    async with client_from(app, "127.0.0.1") as client:
        api = Api(client)
        run = await api.create_run()
        peer = await api.join(run["id"], (await api.create_join_token(run["id"]))["token"])
        assert (await probe(client, run["id"], peer, **body)).status_code == 422


async def rendezvous(client: httpx.AsyncClient, run_id: str, peer: JoinedPeer) -> list[Any]:
    response = await client.get(f"/api/v1/runs/{run_id}/rendezvous", headers=peer.headers)
    assert response.status_code == 200, response.text
    return list(response.json()["peers"])


async def test_a_peer_behind_a_nat_that_punches_is_introduced_to_the_others(
    app: FastAPI, closed_port: int
) -> None:
    """Unreachable but punching: a full member (not a client) at punch://host:port/<id>,
    the host being where its request came from; other peers are introduced to it there,
    nobody is handed it to dial, and nobody is introduced to itself."""
    async with client_from(app, "127.0.0.3") as client:
        api = Api(client)
        run = await api.create_run()
        token = (await api.create_join_token(run["id"]))["token"]
        peer = await api.join(run["id"], token)
        response = await probe(client, run["id"], peer, port=closed_port, punch_port=40404)
        body = response.json()
        own_id = peer.body["peer_id"]
        assert body["reachable"] is False and body["address"] is None
        assert body["punch_address"] == f"punch://127.0.0.3:40404/{own_id}"
        assert "punch through to it at 127.0.0.3:40404" in body["detail"]
        mine = await listed(client, run["id"], peer)
        assert mine["addresses"] == [body["punch_address"]] and mine["client_mode"] is False
        assert await rendezvous(client, run["id"], peer) == []
        other = await api.join(run["id"], token)
        assert await rendezvous(client, run["id"], other) == [
            {"peer_id": own_id, "host": "127.0.0.3", "port": 40404, "relays": []}
        ]
        sample = await client.get(f"/api/v1/runs/{run['id']}/bootstrap", headers=other.headers)
        assert sample.json()["peers"] == [], "a punching peer is not dialed from bootstrap"


async def test_a_peer_cannot_name_where_others_punch(app: FastAPI, closed_port: int) -> None:
    """The host is the coordinator's observation: a join that claims another address, or a
    body that names one, changes nothing; a privileged port is refused."""
    async with client_from(app, "127.0.0.4") as client:
        api = Api(client)
        run = await api.create_run()
        token = (await api.create_join_token(run["id"]))["token"]
        liar = await api.join(run["id"], token, addresses=["punch://192.0.2.7:22/x"])
        refused = await probe(client, run["id"], liar, port=closed_port, punch_port=22)
        assert refused.status_code == 422
        smuggled = await probe(
            client, run["id"], liar, port=closed_port, punch_port=40405, host="192.0.2.7"
        )
        assert smuggled.status_code == 422, "unknown fields are refused"
        await probe(client, run["id"], liar, port=closed_port, punch_port=40405)
        other = await api.join(run["id"], token)
        assert await rendezvous(client, run["id"], other) == [
            {"peer_id": liar.body["peer_id"], "host": "127.0.0.4", "port": 40405, "relays": []}
        ]


async def test_a_peer_that_does_not_punch_is_not_introduced(app: FastAPI, closed_port: int) -> None:
    async with client_from(app, "127.0.0.5") as client:
        api = Api(client)
        run = await api.create_run()
        token = (await api.create_join_token(run["id"]))["token"]
        client_peer = await api.join(run["id"], token)
        await probe(client, run["id"], client_peer, port=closed_port)
        other = await api.join(run["id"], token)
        assert await rendezvous(client, run["id"], other) == []


@pytest.fixture
def relayed_settings(database_url: str) -> Settings:
    return make_settings(
        database_url, reachability_interval_s=0, relays=("relay://relay.example:4100",)
    )


async def test_the_coordinators_relays_are_told_at_join_and_named_per_peer(
    relayed_settings: Settings, closed_port: int
) -> None:
    app = create_app(relayed_settings)
    async with running(app), client_from(app, "127.0.0.6") as client:
        api = Api(client)
        run = await api.create_run()
        token = (await api.create_join_token(run["id"]))["token"]
        peer = await api.join(run["id"], token)
        assert peer.body["relays"] == ["relay://relay.example:4100"]
        await probe(client, run["id"], peer, port=closed_port, punch_port=40406)
        other = await api.join(run["id"], token)
        own_id = peer.body["peer_id"]
        assert await rendezvous(client, run["id"], other) == [
            {
                "peer_id": own_id,
                "host": "127.0.0.6",
                "port": 40406,
                "relays": [f"relay://relay.example:4100/{own_id}"],
            }
        ]


def test_a_relay_setting_that_is_not_a_relay_address_is_refused(database_url: str) -> None:
    with pytest.raises(ValueError, match=re.escape("SWARMGRAD_RELAYS: 'ws://relay.example:4100'")):
        make_settings(database_url, relays=("ws://relay.example:4100",))


async def test_the_dashboard_shows_a_punching_peer_behind_a_nat_not_reachable(
    app: FastAPI, closed_port: int
) -> None:
    async with client_from(app, "127.0.0.7") as client:
        api = Api(client)
        run = await api.create_run()
        token = (await api.create_join_token(run["id"]))["token"]
        peer = await api.join(run["id"], token)
        await probe(client, run["id"], peer, port=closed_port, punch_port=40407)
        table = (await client.get(f"/api/v1/runs/{run['id']}/volunteers")).json()
        (row,) = table["volunteers"]
        assert row["reachable"] is False and row["behind_nat"] is True
        detail = (await client.get(f"/api/v1/runs/{run['id']}/volunteers/{row['id']}")).json()
        (machine,) = detail["machines"]
        assert machine["reachable"] is False and machine["behind_nat"] is True
        assert machine["client_mode"] is False
