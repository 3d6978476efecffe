"""Runs that start when the swarm is there and finish at their last epoch — through the
ASGI app, on SQLite and PostgreSQL: ``min_volunteers`` holds a run paused until that many
distinct volunteers are online (a volunteer's machines count once), the organizer's resume or
a new number starts it; a run finishes by itself once a checkpoint of its last epoch is
stored and the swarm, counted per invite, reported it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi import FastAPI
from sqlalchemy import select, update

from server.config import Settings
from server.models import Peer
from server.services import volunteers as volunteer_service
from tests.server.conftest import ORGANIZER, Api, JoinedPeer, make_settings

OCTETS = {"Content-Type": "application/octet-stream"}


def archive(epoch: int) -> bytes:
    """Bytes that start like a zip archive; the coordinator looks no further."""
    return b"PK\x03\x04" + bytes([epoch % 256]) * 996


@pytest.fixture
def settings(database_url: str, tmp_path: Path) -> Settings:
    # Reports written before the answer: what a test reports is there when it reads.
    return make_settings(
        database_url, checkpoint_dir=tmp_path / "checkpoints", report_flush_interval_s=0
    )


async def read(client: httpx.AsyncClient, run_id: str) -> dict[str, Any]:
    response = await client.get(f"/api/v1/runs/{run_id}")
    assert response.status_code == 200, response.text
    return dict(response.json())


async def invite(api: Api, run_id: str) -> str:
    return str((await api.create_join_token(run_id))["token"])


async def ready(api: Api, run_id: str, token: str | None = None) -> JoinedPeer:
    """A volunteer that joined and, having loaded its task and model, reported (paused, it
    reports to stay online): what a waiting run counts."""
    joined = await api.join(run_id, token if token is not None else await invite(api, run_id))
    reply = await api.report(run_id, joined)
    assert reply.status_code == 202, reply.text
    return joined


async def patch(client: httpx.AsyncClient, run_id: str, **body: Any) -> httpx.Response:
    return await client.patch(f"/api/v1/runs/{run_id}", json=body, headers=ORGANIZER)


# ------------------------------------------------------------------------------ waiting


async def test_a_run_waits_until_enough_volunteers_are_online_then_starts(
    api: Api, client: httpx.AsyncClient
) -> None:
    run = await api.create_run(min_volunteers=3)
    assert run["status"] == "paused" and run["min_volunteers"] == 3
    assert run["status_detail"] == "waiting for 3 volunteers (0 online)"
    first = await ready(api, run["id"])
    assert first.body["status"] == "paused"
    await ready(api, run["id"])
    waiting = await read(client, run["id"])
    assert waiting["status"] == "paused" and waiting["volunteers_online"] == 2
    assert waiting["status_detail"] == "waiting for 3 volunteers (2 online)"
    listed = (await client.get("/api/v1/runs")).json()["runs"]
    assert listed[0]["status_detail"] == "waiting for 3 volunteers (2 online)"

    third = await api.join(run["id"], await invite(api, run["id"]))
    # joined, still loading its task: not counted yet (the first ready one would train alone)
    assert third.body["status"] == "paused"
    assert (await read(client, run["id"]))["status_detail"] == (
        "waiting for 3 volunteers (2 online)"
    )
    assert (await api.report(run["id"], third)).status_code == 202  # its first report
    started = await read(client, run["id"])
    assert started["status"] == "running"
    assert started["min_volunteers"] is None and started["status_detail"] is None


async def test_a_volunteers_machines_count_once(
    app: FastAPI, api: Api, client: httpx.AsyncClient
) -> None:
    run = await api.create_run(min_volunteers=2)
    with app.state.session_factory() as session, session.begin():
        code = await invite(api, run["id"])
        redeemed = volunteer_service.redeem_invite(session, code, "ada", token_ttl_s=3600)
    for _ in range(3):
        await ready(api, run["id"], redeemed.token)
    assert (await read(client, run["id"]))["status_detail"] == (
        "waiting for 2 volunteers (1 online)"
    )
    await ready(api, run["id"])
    assert (await read(client, run["id"]))["status"] == "running"


async def test_volunteers_gone_offline_do_not_count_and_a_report_starts_it(
    app: FastAPI, api: Api, client: httpx.AsyncClient, settings: Settings
) -> None:
    run = await api.create_run(min_volunteers=2)
    early = await ready(api, run["id"])
    # silent for longer than the online TTL
    stale = int(settings.peer_online_ttl_s * 1000) + 5000
    with app.state.session_factory() as session, session.begin():
        session.execute(
            update(Peer)
            .where(Peer.peer_id == early.body["peer_id"])
            .values(last_seen_ms=Peer.last_seen_ms - stale)
        )
    await ready(api, run["id"])
    assert (await read(client, run["id"]))["status_detail"] == (
        "waiting for 2 volunteers (1 online)"
    )
    # the early one is back: its report (a paused volunteer reports to stay online)
    assert (await api.report(run["id"], early)).status_code == 202
    assert (await read(client, run["id"]))["status"] == "running"


async def test_the_organizer_starts_a_waiting_run_or_changes_its_number(
    api: Api, client: httpx.AsyncClient
) -> None:
    run = await api.create_run(min_volunteers=5)
    await ready(api, run["id"])
    await ready(api, run["id"])

    lowered = await patch(client, run["id"], min_volunteers=2)
    assert lowered.status_code == 200, lowered.text
    assert lowered.json()["status"] == "running"  # two are online already

    held = await patch(client, run["id"], min_volunteers=4)
    assert held.json()["status"] == "paused"
    assert held.json()["status_detail"] == "waiting for 4 volunteers (2 online)"

    stop_waiting = await patch(client, run["id"], min_volunteers=None)
    assert stop_waiting.json()["status"] == "paused"
    assert stop_waiting.json()["status_detail"] is None  # the organizer's own pause
    await api.join(run["id"], await invite(api, run["id"]))
    await api.join(run["id"], await invite(api, run["id"]))
    assert (await read(client, run["id"]))["status"] == "paused"  # waits for nobody now

    await patch(client, run["id"], min_volunteers=10)
    resumed = await patch(client, run["id"], status="running")
    assert resumed.json()["status"] == "running" and resumed.json()["min_volunteers"] is None


async def test_bad_numbers_are_refused(api: Api, client: httpx.AsyncClient) -> None:
    for bad in (0, -1, 10**7, "three", 2.5):
        response = await client.post(
            "/api/v1/runs",
            json={"name": "x", "task": "digits", "min_volunteers": bad},
            headers=ORGANIZER,
        )
        assert response.status_code == 422, (bad, response.text)
    run = await api.create_run()
    ended = await patch(client, run["id"], status="finished", min_volunteers=2)
    assert ended.status_code == 409 and "waits for nobody" in ended.text
    assert (await read(client, run["id"]))["status"] == "running"
    # with both, the status applies first, then the hold
    held = await patch(client, run["id"], status="running", min_volunteers=2)
    assert held.status_code == 200, held.text
    assert held.json()["status_detail"] == "waiting for 2 volunteers (0 online)"


async def test_banned_volunteers_do_not_count(
    app: FastAPI, api: Api, client: httpx.AsyncClient
) -> None:
    run = await api.create_run(min_volunteers=2)
    banned = await ready(api, run["id"])
    with app.state.session_factory() as session:
        volunteer_id = session.scalar(
            select(Peer.volunteer_id).where(Peer.peer_id == banned.body["peer_id"])
        )
    response = await client.post(
        f"/api/v1/runs/{run['id']}/volunteers/{volunteer_id}/ban", headers=ORGANIZER
    )
    assert response.status_code == 200, response.text
    await ready(api, run["id"])
    assert (await read(client, run["id"]))["status_detail"] == (
        "waiting for 2 volunteers (1 online)"
    )


# ------------------------------------------------------------------------------ finishing


async def reach(api: Api, run_id: str, peers: list[JoinedPeer], epoch: int) -> None:
    for peer in peers:
        answer = await api.report(run_id, peer, epoch=epoch, samples=100 * epoch)
        assert answer.status_code == 202, answer.text


async def upload(
    client: httpx.AsyncClient, run_id: str, peer: JoinedPeer, epoch: int
) -> httpx.Response:
    return await client.put(
        f"/api/v1/runs/{run_id}/checkpoint?epoch={epoch}",
        content=archive(epoch),
        headers={**peer.headers, **OCTETS},
    )


async def swarm(api: Api, run_id: str, n: int) -> list[JoinedPeer]:
    """``n`` volunteers, each through an invite of its own, lowest peer id first."""
    peers = [await api.join(run_id, await invite(api, run_id)) for _ in range(n)]
    return sorted(peers, key=lambda p: p.body["peer_id"])


async def test_a_run_finishes_by_itself_at_its_last_epoch(
    api: Api, client: httpx.AsyncClient
) -> None:
    run = await api.create_run(config={"epochs": 3})
    peers = await swarm(api, run["id"], 3)
    await reach(api, run["id"], peers, 2)
    assert (await upload(client, run["id"], peers[0], 2)).status_code == 201
    assert (await read(client, run["id"]))["status"] == "running"

    await reach(api, run["id"], peers, 3)  # reports first: no checkpoint of epoch 3 yet
    assert (await read(client, run["id"]))["status"] == "running"
    assert (await upload(client, run["id"], peers[0], 3)).status_code == 201
    finished = await read(client, run["id"])
    assert finished["status"] == "finished" and finished["finished_at_epoch"] == 3
    assert finished["status_detail"] == "reached its last epoch 3"
    progress = (await client.get(f"/api/v1/runs/{run['id']}/progress")).json()
    assert progress["status"] == "finished"


async def test_the_checkpoint_first_then_the_reports_finish_it(
    api: Api, client: httpx.AsyncClient
) -> None:
    run = await api.create_run(config={"epochs": 2})
    peers = await swarm(api, run["id"], 2)
    await reach(api, run["id"], peers, 1)
    assert (await upload(client, run["id"], peers[0], 2)).status_code == 201
    assert (await read(client, run["id"]))["status"] == "running"
    await reach(api, run["id"], peers[:1], 2)
    assert (await read(client, run["id"]))["status"] == "running"  # one of two invites
    await reach(api, run["id"], peers[1:], 2)
    assert (await read(client, run["id"]))["status"] == "finished"


async def test_a_run_without_epochs_or_paused_never_finishes_by_itself(
    api: Api, client: httpx.AsyncClient
) -> None:
    endless = await api.create_run(config={"epochs": None})
    peers = await swarm(api, endless["id"], 2)
    await reach(api, endless["id"], peers, 5)
    assert (await upload(client, endless["id"], peers[0], 5)).status_code == 201
    assert (await read(client, endless["id"]))["status"] == "running"

    paused = await api.create_run("paused", config={"epochs": 1})
    others = await swarm(api, paused["id"], 2)
    await patch(client, paused["id"], status="paused")
    await reach(api, paused["id"], others, 1)
    assert (await upload(client, paused["id"], others[0], 1)).status_code == 201
    assert (await read(client, paused["id"]))["status"] == "paused"


async def test_the_organizers_finish_states_no_epoch(api: Api, client: httpx.AsyncClient) -> None:
    run = await api.create_run(config={"epochs": 3})
    finished = await patch(client, run["id"], status="finished")
    assert finished.json()["status"] == "finished"
    assert finished.json()["finished_at_epoch"] is None
    assert finished.json()["status_detail"] is None


# ------------------------------------------------------------------------------ dashboard


async def test_the_dashboard_states_why_a_run_waits_or_finished(
    api: Api, client: httpx.AsyncClient
) -> None:
    run = await api.create_run(min_volunteers=2, config={"epochs": 1})
    peers = [await ready(api, run["id"])]
    waiting = "waiting for 2 volunteers (1 online)"
    document = (await client.get(f"/api/v1/runs/{run['id']}/dashboard")).json()
    assert document["run"]["status_detail"] == waiting
    overview = (await client.get("/api/v1/dashboard")).json()
    assert overview["runs"][0]["status_detail"] == waiting
    page = (await client.get(f"/runs/{run['id']}")).text
    assert f"paused: {waiting}" in page
    assert waiting in (await client.get("/")).text

    peers.append(await ready(api, run["id"]))  # the second starts it
    await reach(api, run["id"], peers, 1)
    peers.sort(key=lambda p: p.body["peer_id"])
    assert (await upload(client, run["id"], peers[0], 1)).status_code == 201
    document = (await client.get(f"/api/v1/runs/{run['id']}/dashboard")).json()
    assert document["run"]["status"] == "finished"
    assert document["run"]["status_detail"] == "reached its last epoch 1"
    page = (await client.get(f"/runs/{run['id']}")).text
    assert "finished: reached its last epoch 1" in page


async def test_finishing_a_run_that_finished_by_itself_changes_nothing(
    api: Api, client: httpx.AsyncClient
) -> None:
    run = await api.create_run(config={"epochs": 1})
    peers = await swarm(api, run["id"], 2)
    await reach(api, run["id"], peers, 1)
    assert (await upload(client, run["id"], peers[0], 1)).status_code == 201
    again = await patch(client, run["id"], status="finished")
    assert again.status_code == 200, again.text
    assert again.json()["status_detail"] == "reached its last epoch 1"
    assert (await patch(client, run["id"], status="running")).status_code == 409
    assert (await patch(client, run["id"], min_volunteers=2)).status_code == 409


async def test_the_organizer_holds_a_run_from_its_page(api: Api, client: httpx.AsyncClient) -> None:
    from tests.server.test_pages import csrf_of, sign_in

    run = await api.create_run()
    await ready(api, run["id"])
    anonymous = await client.post(
        f"/runs/{run['id']}/wait", data={"csrf": await csrf_of(client), "min_volunteers": "1"}
    )
    assert anonymous.status_code == 403 and "Sign in as an organizer" in anonymous.text
    await sign_in(client)
    csrf = await csrf_of(client, f"/runs/{run['id']}")
    for bad in ("0", "many", ""):
        refused = await client.post(
            f"/runs/{run['id']}/wait", data={"csrf": csrf, "min_volunteers": bad}
        )
        assert refused.status_code == 422 and "at least 1" in refused.text
    held = await client.post(f"/runs/{run['id']}/wait", data={"csrf": csrf, "min_volunteers": "2"})
    assert held.status_code == 303
    page = (await client.get(f"/runs/{run['id']}")).text
    assert "paused: waiting for 2 volunteers (1 online)" in page
    assert "starts by itself once they are online" in page  # the organizer's hint
    started = await client.post(
        f"/runs/{run['id']}/wait", data={"csrf": csrf, "min_volunteers": "1"}
    )
    assert started.status_code == 303
    assert (await read(client, run["id"]))["status"] == "running"  # one is online already
