"""``POST /runs/{run_id}/leave``: a peer that stops says so and shows offline at once in
every place that counts peers online; its next report brings it back."""

from __future__ import annotations

from typing import Any

import httpx
from fastapi import FastAPI
from sqlalchemy import select

from server.clock import now_ms
from server.models import Peer
from swarmlab.node_process import wait_until_async
from tests.conftest import scaled
from tests.server.conftest import ORGANIZER, Api, JoinedPeer, bearer


async def online_everywhere(client: httpx.AsyncClient, run_id: str) -> dict[str, Any]:
    """Who is online, as each document a person or a peer reads tells it."""
    dashboard = (await client.get(f"/api/v1/runs/{run_id}/dashboard")).json()
    progress = (await client.get(f"/api/v1/runs/{run_id}/progress")).json()
    volunteers = (await client.get(f"/api/v1/runs/{run_id}/volunteers")).json()
    listed = (await client.get(f"/api/v1/runs/{run_id}/peers", headers=ORGANIZER)).json()
    bob = (await client.get(f"/api/v1/runs/{run_id}/volunteers/bob")).json()
    overview = (await client.get("/api/v1/dashboard")).json()
    return {
        "headline": dashboard["headline"]["peers_online"],
        "progress": progress["peers_online"],
        "overview": next(r for r in overview["runs"] if r["id"] == run_id)["peers_online"],
        "volunteers_online": volunteers["volunteers_page"]["online"],
        "rows": {v["display_name"]: v["online"] for v in dashboard["volunteers"]},
        "bob_machines": [m["online"] for m in bob["machines"]],
        "peers": {p["display_name"]: p["online"] for p in listed["peers"]},
        "bob_last_seen": next(p for p in listed["peers"] if p["display_name"] == "bob")[
            "last_seen_at"
        ],
    }


def left_ms(app: FastAPI, peer: JoinedPeer) -> int | None:
    with app.state.session_factory() as session:
        return session.scalar(select(Peer.left_ms).where(Peer.peer_id == peer.body["peer_id"]))


async def test_a_peer_that_leaves_is_offline_at_once_and_back_with_its_next_report(
    app: FastAPI, client: httpx.AsyncClient, api: Api
) -> None:
    run = await api.create_run(name="leaving")
    invite = (await api.create_join_token(run["id"]))["token"]
    ada = await api.join(run["id"], invite, display_name="ada")
    bob = await api.join(run["id"], invite, display_name="bob")
    for peer in (ada, bob):
        assert (await api.report(run["id"], peer, epoch=1, samples=10)).status_code == 202
    await app.state.report_buffer.flush()
    before = await online_everywhere(client, run["id"])
    assert before["headline"] == before["progress"] == before["overview"] == 2
    assert before["rows"] == before["peers"] == {"ada": True, "bob": True}

    url = f"/api/v1/runs/{run['id']}/leave"
    assert (await client.post(url)).status_code == 401
    assert (await client.post(url, headers=bearer("sgp_nope.nothing"))).status_code == 401
    assert left_ms(app, bob) is None
    for _ in range(2):  # idempotent
        response = await client.post(url, headers=bob.headers)
        assert response.status_code == 204, response.text
    gone = await online_everywhere(client, run["id"])
    assert gone["headline"] == gone["progress"] == gone["overview"] == 1
    assert gone["volunteers_online"] == 1 and gone["bob_machines"] == [False]
    assert gone["rows"] == gone["peers"] == {"ada": True, "bob": False}
    assert gone["bob_last_seen"] == before["bob_last_seen"]  # the real last contact

    # A report after the leave (on the coordinator's clock) brings it back.
    left = left_ms(app, bob)
    assert left is not None
    assert await wait_until_async(lambda: now_ms() > left, scaled(5))
    assert (await api.report(run["id"], bob, epoch=2, samples=20)).status_code == 202
    await app.state.report_buffer.flush()
    back = await online_everywhere(client, run["id"])
    assert back["headline"] == back["progress"] == back["overview"] == 2
    assert back["rows"] == back["peers"] == {"ada": True, "bob": True}


async def test_a_peer_can_make_only_itself_leave(
    app: FastAPI, client: httpx.AsyncClient, api: Api
) -> None:
    run = await api.create_run(name="mine")
    other_run = await api.create_run(name="theirs")
    ada = await api.join(run["id"], (await api.create_join_token(run["id"]))["token"])
    eve = await api.join(other_run["id"], (await api.create_join_token(other_run["id"]))["token"])
    # Another run's peer token is refused on this run; the organizer's is not a peer's.
    url = f"/api/v1/runs/{run['id']}/leave"
    assert (await client.post(url, headers=eve.headers)).status_code == 403
    assert (await client.post(url, headers=ORGANIZER)).status_code == 403
    assert left_ms(app, ada) is None
    # A peer's own leave touches no other peer, whoever else is in the run.
    bob = await api.join(run["id"], (await api.create_join_token(run["id"]))["token"])
    assert (await client.post(url, headers=bob.headers)).status_code == 204
    assert left_ms(app, ada) is None and left_ms(app, bob) is not None
    assert left_ms(app, eve) is None
    sample = await client.get(f"/api/v1/runs/{run['id']}/bootstrap", headers=ada.headers)
    assert sample.status_code == 200
