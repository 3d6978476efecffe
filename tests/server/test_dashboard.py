"""The dashboard's documents: alert rules and ETA as pure functions, then the JSON endpoints
over real reports (SQLite and PostgreSQL), personal credentials from invites, and bans."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import httpx
import pytest
from fastapi import FastAPI
from sqlalchemy import update

from server.models import Token, utcnow
from server.services.dashboard import AlertInputs, alerts, eta_seconds
from server.services.volunteers import InviteUnusable, inspect_invite, redeem_invite
from tests.server.conftest import ORGANIZER, Api, bearer

# ----------------------------------------------------------------------------- pure rules


def quiet(**changes: Any) -> AlertInputs:
    values: dict[str, Any] = {
        "running": True,
        "loss_nan_peers": 0,
        "losses": [2.0, 1.9, 1.8, 1.7, 1.6, 1.5],
        "peers_online": [3, 3, 3],
        "current_peers": 3,
        "rounds": [(10, 0), (10, 1)],
        "seconds_since_last_report": 2.0,
    }
    values.update(changes)
    return AlertInputs(**values)


def kinds(inputs: AlertInputs) -> list[str]:
    return [a.kind for a in alerts(inputs)]


def test_a_healthy_run_has_no_alert() -> None:
    assert alerts(quiet()) == []


def test_each_alert_fires_on_its_condition_only() -> None:
    assert kinds(quiet(loss_nan_peers=2)) == ["loss_nan"]
    assert kinds(quiet(losses=[1.0, 1.0, 0.9, 0.9, 0.8, 2.5])) == ["loss_jump"]
    assert kinds(quiet(losses=[1.0, 1.0, 0.9, 0.9, 0.8, 1.5])) == []  # under twice the median
    assert kinds(quiet(peers_online=[4, 4, 4], current_peers=2)) == ["peers_collapse"]
    assert kinds(quiet(peers_online=[4, 4, 4], current_peers=3)) == []
    assert kinds(quiet(rounds=[(1, 3), (0, 2)])) == ["rounds_failing"]
    assert kinds(quiet(rounds=[(0, 2)])) == []  # too few rounds to say
    assert kinds(quiet(seconds_since_last_report=600)) == ["stalled"]
    assert kinds(quiet(seconds_since_last_report=600, running=False)) == []  # paused: expected


def test_critical_alerts_come_first_and_say_what_happened() -> None:
    found = alerts(
        quiet(seconds_since_last_report=600, peers_online=[5, 5], current_peers=0, loss_nan_peers=1)
    )
    assert [a.severity for a in found] == ["critical", "critical", "warning"]
    assert found[0].message == "The loss is NaN or infinite on 1 peer(s)."
    assert "fell to 0 from 5" in found[1].message


def test_eta_from_the_pace_of_recent_epochs() -> None:
    starts = [30_000, 10_000, 20_000]  # any order; 10 s per epoch
    assert eta_seconds(3, 10, starts) == pytest.approx(70.0)
    assert eta_seconds(10, 10, starts) == 0.0
    assert eta_seconds(3, None, starts) is None
    assert eta_seconds(3, 10, [10_000]) is None


# ----------------------------------------------------------------------------- endpoints


async def flush(app: FastAPI) -> None:
    await app.state.report_buffer.flush()


async def dashboard(client: httpx.AsyncClient, run_id: str) -> dict[str, Any]:
    response = await client.get(f"/api/v1/runs/{run_id}/dashboard")
    assert response.status_code == 200, response.text
    return response.json()


async def test_dashboard_shows_headline_volunteers_groups_and_alerts(
    app: FastAPI, client: httpx.AsyncClient, api: Api, join_token: str
) -> None:
    run = await api.create_run(name="dash", config={"epochs": 20})
    invite = (await api.create_join_token(run["id"]))["token"]
    a = await api.join(run["id"], invite, display_name="ada")
    b = await api.join(run["id"], invite, display_name="bob", client_mode=True, addresses=[])
    for peer, samples, group, loss in ((a, 300, 2, 1.5), (b, 100, 2, 1.7)):
        response = await api.report(
            run["id"], peer, epoch=3, samples=samples, samples_per_second=10.0, loss=loss,
            group_size=group, rounds_done=3,
        )  # fmt: skip
        assert response.status_code == 202
    await api.report(run["id"], b, epoch=3, samples=120, loss=None, loss_nan=True, group_size=1)
    await flush(app)

    document = await dashboard(client, run["id"])
    assert document["run"]["target_epochs"] == 20 and document["run"]["name"] == "dash"
    headline = document["headline"]
    assert (headline["epoch"], headline["samples"], headline["peers_online"]) == (3, 420, 2)
    assert headline["loss"] == 1.5  # bob's latest loss was NaN: not averaged in
    assert headline["rounds_done"] == 6 and headline["checkpoint"] is None
    assert [a["kind"] for a in document["alerts"]] == ["loss_nan"]
    assert document["group_sizes"]["recent"] == [2, 2, 1]
    assert document["group_sizes"]["histogram"] == [
        {"size": 1, "count": 1},
        {"size": 2, "count": 2},
    ]
    rows = {v["display_name"]: v for v in document["volunteers"]}
    assert [v["display_name"] for v in document["volunteers"]] == ["ada", "bob"]  # by samples
    assert rows["ada"]["share"] == pytest.approx(300 / 420) and rows["ada"]["reachable"]
    assert not rows["bob"]["reachable"] and rows["bob"]["online"] and not rows["bob"]["banned"]
    assert document["version"]

    again = await dashboard(client, run["id"])
    assert again["version"] == document["version"]  # nothing changed but the clock

    overview = (await client.get("/api/v1/dashboard")).json()
    row = next(r for r in overview["runs"] if r["id"] == run["id"])
    assert (row["samples"], row["peers_online"], row["task"]) == (420, 2, "mnist-mlp")

    by_name = await client.get(f"/api/v1/runs/{run['id']}/volunteers/bob")
    assert by_name.status_code == 200, by_name.text
    detail = by_name.json()
    assert detail["volunteer"]["rank"] == 2 and detail["volunteer"]["of"] == 2
    assert detail["volunteer"]["samples"] == 120
    assert detail["series"]["samples"][-1] == 120
    assert [m["client_mode"] for m in detail["machines"]] == [True]
    assert len(detail["sessions"]) == 1 and detail["sessions"][0]["ended"] is None
    by_id = await client.get(f"/api/v1/runs/{run['id']}/volunteers/{detail['volunteer']['id']}")
    assert by_id.json()["volunteer"]["display_name"] == "bob"
    missing = await client.get(f"/api/v1/runs/{run['id']}/volunteers/nobody")
    assert missing.status_code == 404


async def test_a_counter_reset_does_not_shrink_a_volunteers_chart(
    app: FastAPI, client: httpx.AsyncClient, api: Api, run: dict[str, Any], join_token: str
) -> None:
    peer = await api.join(run["id"], join_token, display_name="eve")
    for samples in (50, 80, 10, 30):  # restarted from zero after 80
        await api.report(run["id"], peer, epoch=1, samples=samples)
        await flush(app)
    detail = (await client.get(f"/api/v1/runs/{run['id']}/volunteers/eve")).json()
    assert detail["series"]["samples"] == [50, 80, 90, 110]
    assert detail["volunteer"]["samples"] == 110


async def test_an_invite_redeemed_gives_a_personal_token_for_several_machines(
    app: FastAPI, client: httpx.AsyncClient, api: Api, run: dict[str, Any]
) -> None:
    invite = (await api.create_join_token(run["id"], max_uses=1))["token"]
    with app.state.session_factory() as session:
        redeemed = redeem_invite(session, invite, "  carol  ", token_ttl_s=3600)
        session.commit()
        assert redeemed.volunteer.display_name == "carol"
        with pytest.raises(InviteUnusable, match=r"^This invite has been used up\.$"):
            inspect_invite(session, invite)
    personal = redeemed.token
    first = await api.join(run["id"], personal, display_name="ignored")
    second = await api.join(run["id"], personal)
    document = await dashboard(client, run["id"])
    assert [(v["display_name"], v["peers"]) for v in document["volunteers"]] == [("carol", 2)]
    assert first.body["peer_id"] != second.body["peer_id"]


async def test_unusable_invites_say_why_in_words(
    app: FastAPI, api: Api, run: dict[str, Any]
) -> None:
    revoked = await api.create_join_token(run["id"])
    expired = await api.create_join_token(run["id"])
    response = await api.client.delete(
        f"/api/v1/runs/{run['id']}/tokens/{revoked['id']}", headers=ORGANIZER
    )
    assert response.status_code == 204
    with app.state.session_factory() as session:
        session.execute(
            update(Token)
            .where(Token.id == expired["id"])
            .values(expires_at=utcnow() - timedelta(seconds=1))
        )
        session.commit()
        cases = {
            revoked["token"]: "This invite was revoked.",
            expired["token"]: "This invite has expired.",
            "sgj_nonsense": "This invite is not valid.",
            ORGANIZER["Authorization"].split()[1]: "This invite is not valid.",
        }
        for invite, words in cases.items():
            with pytest.raises(InviteUnusable) as caught:
                inspect_invite(session, invite)
            assert str(caught.value) == words


async def test_a_ban_revokes_renewal_rejoin_and_shows_in_the_table(
    app: FastAPI, client: httpx.AsyncClient, api: Api, run: dict[str, Any]
) -> None:
    invite = (await api.create_join_token(run["id"]))["token"]
    with app.state.session_factory() as session:
        redeemed = redeem_invite(session, invite, "mallory", token_ttl_s=3600)
        session.commit()
        volunteer_id = redeemed.volunteer.id
    peer = await api.join(run["id"], redeemed.token)
    renew = f"/api/v1/runs/{run['id']}/certificate"
    assert (await client.post(renew, headers=peer.headers)).status_code == 200

    ban = f"/api/v1/runs/{run['id']}/volunteers/{volunteer_id}/ban"
    assert (await client.post(ban, headers=peer.headers)).status_code == 403  # not an organizer
    response = await client.post(ban, headers=ORGANIZER)
    assert response.status_code == 200 and response.json()["banned"] is True
    assert (await client.post(ban, headers=ORGANIZER)).status_code == 200  # idempotent

    assert (await client.post(renew, headers=peer.headers)).status_code == 401
    again = await client.post("/api/v1/join/challenge", headers=bearer(redeemed.token))
    assert again.status_code == 401
    # Even with a fresh invite, the banned key is refused.
    other = (await api.create_join_token(run["id"]))["token"]
    refused = await api.join(run["id"], other, peer.identity, expect=403)
    assert "banned" in refused.body["detail"]
    row = (await dashboard(client, run["id"]))["volunteers"][0]
    assert row["display_name"] == "mallory" and row["banned"] is True
