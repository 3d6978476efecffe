"""Peers' claims of bytes sent and compute utilisation: bounded on the way in, kept per peer,
and shown as the run's bytes per sample."""

from __future__ import annotations

from typing import Any

import httpx
import pytest
from fastapi import FastAPI
from sqlalchemy import select

from server.models import Peer
from tests.server.conftest import Api


async def test_bytes_per_sample_sums_the_peers_that_report_them(
    app: FastAPI, api: Api, client: httpx.AsyncClient, run: dict[str, Any], join_token: str
) -> None:
    a = await api.join(run["id"], join_token)
    b = await api.join(run["id"], join_token)
    c = await api.join(run["id"], join_token)  # an older volunteer: no bytes reported
    for peer, body in [
        (a, {"samples": 100, "bytes_sent": 50_000, "compute_utilisation": 0.97}),
        (b, {"samples": 300, "bytes_sent": 10_000, "compute_utilisation": 0.5}),
        (c, {"samples": 1000}),
        (a, {"samples": 200}),  # a report without the claims keeps the last ones
    ]:
        response = await api.report(run["id"], peer, **body)
        assert response.status_code == 202, response.text
    await app.state.report_buffer.flush()
    progress = (await client.get(f"/api/v1/runs/{run['id']}/progress")).json()
    assert progress["samples"] == 1500
    # (50,000 + 10,000) bytes over a's 200 and b's 300 samples; c counts for neither
    assert progress["bytes_per_sample"] == pytest.approx(60_000 / 500)
    with app.state.session_factory() as session:
        rows = dict(session.execute(select(Peer.peer_id, Peer.compute_utilisation)).all())
    assert rows[a.body["peer_id"]] == pytest.approx(0.97)
    assert rows[b.body["peer_id"]] == pytest.approx(0.5)
    assert rows[c.body["peer_id"]] is None


@pytest.mark.parametrize(
    "claim",
    [
        {"bytes_sent": -1},
        {"bytes_sent": 2**63},
        {"bytes_sent": "many"},
        {"compute_utilisation": 1.5},
        {"compute_utilisation": -0.1},
    ],
)
async def test_claims_out_of_bounds_are_422(
    api: Api, run: dict[str, Any], join_token: str, claim: dict[str, Any]
) -> None:
    peer = await api.join(run["id"], join_token)
    response = await api.report(run["id"], peer, samples=10, **claim)
    assert response.status_code == 422, response.text


async def test_the_dashboard_shows_bytes_per_sample_and_each_machines_utilisation(
    app: FastAPI, api: Api, client: httpx.AsyncClient
) -> None:
    run = await api.create_run(name="wan", config={"algorithm": "diloco", "inner_steps": 10})
    invite = (await api.create_join_token(run["id"]))["token"]
    ada = await api.join(run["id"], invite, display_name="ada")
    response = await api.report(
        run["id"], ada, epoch=2, samples=640, bytes_sent=64_000, compute_utilisation=0.96
    )
    assert response.status_code == 202, response.text
    await app.state.report_buffer.flush()
    document = (await client.get(f"/api/v1/runs/{run['id']}/dashboard")).json()
    assert document["headline"]["epoch"] == 2  # DiLoCo's epochs: outer syncs
    assert document["headline"]["bytes_per_sample"] == pytest.approx(100.0)
    detail = (await client.get(f"/api/v1/runs/{run['id']}/volunteers/ada")).json()
    assert [m["compute_utilisation"] for m in detail["machines"]] == [pytest.approx(0.96)]
    page = (await client.get(f"/runs/{run['id']}")).text
    assert 'data-metric="bytes_per_sample">100<' in page
