"""A swarm that cannot average is flagged on the dashboard with the reason and what helps:
the rules as pure functions, then through the app over real reports (SQLite and PostgreSQL)."""

from __future__ import annotations

from typing import Any

import httpx
from fastapi import FastAPI

from server.services.averaging_health import NO_GROUP_ROUNDS, PeerAveraging, findings
from tests.server.conftest import Api, reached

# ----------------------------------------------------------------------------- pure rules


def peer(name: str, **changes: Any) -> PeerAveraging:
    values: dict[str, Any] = {
        "name": name,
        "reachability": "dialable",
        "reported": True,
        "averaged": True,
        "rounds_without": 0,
        "largest_group": 4,
    }
    values.update(changes)
    return PeerAveraging(**values)


def alone(name: str, reachability: str = "client") -> PeerAveraging:
    return peer(
        name,
        reachability=reachability,
        averaged=False,
        rounds_without=NO_GROUP_ROUNDS,
        largest_group=None,
    )


def test_a_swarm_that_averages_together_has_no_alert() -> None:
    assert findings([peer(n) for n in "abcd"]) == []
    assert findings([alone("a")]) == []  # alone in the run: nobody to average with
    assert findings([peer("a", reported=False), peer("b", reported=False)]) == []


def test_nobody_averaging_says_why_from_the_coordinators_records() -> None:
    (found,) = findings([alone("a"), alone("b"), alone("c")])
    assert (found.kind, found.severity) == ("not_averaging", "critical")
    assert found.message.startswith("3 volunteers online, none averaged in their last 3+")
    assert "none of them can be reached" in found.message
    assert found.help is not None
    assert "forward a port" in found.help and "docs/deploy.md" in found.help

    (punching,) = findings([alone("a", "punching"), alone("b", "punching")])
    assert "hole punching does not connect them" in punching.message
    (failing,) = findings([alone("a", "dialable"), alone("b", "client")])
    assert "links to the others fail" in failing.message


def test_one_volunteer_cannot_raise_or_hide_the_swarms_alarm() -> None:
    # one liar among averaging peers: flagged by name, not the whole run
    (found,) = findings([alone("mallory"), peer("a"), peer("b"), peer("c")])
    assert found.kind == "no_group" and found.message.startswith("mallory found no group")
    # one liar claiming rounds among peers that found no group: the run is still flagged
    (found,) = findings([peer("mallory"), alone("a"), alone("b")])
    assert found.kind == "not_averaging"
    assert found.message.startswith("3 volunteers online, 2 of them found no group")


def test_islands_groups_that_never_mix() -> None:
    pairs = [peer(n, largest_group=2) for n in "abcdef"]
    (found,) = findings(pairs)
    assert found.kind == "islands" and "groups of at most 2" in found.message
    # one peer claiming a large group does not hide them
    assert [f.kind for f in findings([*pairs, peer("mallory", largest_group=7)])] == ["islands"]
    assert findings([peer(n, largest_group=6) for n in "abcdef"]) == []


# ----------------------------------------------------------------------------- endpoints


async def averaging_alerts(app: FastAPI, client: httpx.AsyncClient, run_id: str) -> list[Any]:
    await app.state.report_buffer.flush()
    response = await client.get(f"/api/v1/runs/{run_id}/dashboard")
    assert response.status_code == 200, response.text
    kinds = ("not_averaging", "no_group", "islands")
    return [a for a in response.json()["alerts"] if a["kind"] in kinds]


async def test_client_mode_volunteers_that_find_no_group_flag_the_run(
    app: FastAPI, client: httpx.AsyncClient, api: Api
) -> None:
    run = await api.create_run(name="homes")
    invite = (await api.create_join_token(run["id"]))["token"]
    peers = [
        await api.join(run["id"], invite, display_name=name, client_mode=True, addresses=[])
        for name in ("ann", "ben", "cat")
    ]
    for p in peers:
        assert (await api.report(run["id"], p, epoch=1, rounds_failed=1)).status_code == 202
    assert await averaging_alerts(app, client, run["id"]) == []  # one round: too early to say

    for p in peers:
        response = await api.report(run["id"], p, epoch=3, rounds_failed=NO_GROUP_ROUNDS - 1)
        assert response.status_code == 202
    (found,) = await averaging_alerts(app, client, run["id"])
    assert found["kind"] == "not_averaging" and found["severity"] == "critical"
    assert "3 volunteers online" in found["message"]
    assert "none of them can be reached" in found["message"]
    assert "forward a port" in found["help"] and "run a relay" in found["help"]

    # a round completes for most of them: the alarm goes, the one left is named
    for p in peers[:2]:
        response = await api.report(run["id"], p, epoch=4, rounds_done=1, group_size=2)
        assert response.status_code == 202
    (found,) = await averaging_alerts(app, client, run["id"])
    assert found["kind"] == "no_group" and found["message"].startswith("cat found no group")


async def test_one_volunteers_claim_does_not_flag_a_swarm_that_averages(
    app: FastAPI, client: httpx.AsyncClient, api: Api
) -> None:
    run = await api.create_run(name="mixed")
    invite = (await api.create_join_token(run["id"]))["token"]
    honest = [await api.join(run["id"], invite, display_name=n) for n in ("ann", "ben", "cat")]
    mallory = await api.join(run["id"], invite, display_name="mallory")
    reached(app, mallory, "ws://127.0.0.1:4000")
    for p in honest:
        response = await api.report(run["id"], p, epoch=5, rounds_done=5, group_size=4)
        assert response.status_code == 202
    response = await api.report(run["id"], mallory, epoch=5, rounds_failed=50)
    assert response.status_code == 202
    (found,) = await averaging_alerts(app, client, run["id"])
    assert found["kind"] == "no_group" and found["severity"] == "warning"
    assert found["message"].startswith("mallory found no group")
    assert "links to the others fail" in found["message"]  # the coordinator reached mallory


async def test_volunteers_averaging_in_pairs_that_never_mix_are_islands(
    app: FastAPI, client: httpx.AsyncClient, api: Api
) -> None:
    run = await api.create_run(name="islands")
    invite = (await api.create_join_token(run["id"]))["token"]
    peers = [await api.join(run["id"], invite, display_name=n) for n in ("a", "b", "c", "d")]
    for p in peers:
        response = await api.report(run["id"], p, epoch=6, rounds_done=6, group_size=2)
        assert response.status_code == 202
    (found,) = await averaging_alerts(app, client, run["id"])
    assert found["kind"] == "islands"
    assert found["message"].startswith("4 volunteers average, but in separate groups of at most 2")

    for p in peers[:3]:  # they meet: groups of four
        response = await api.report(run["id"], p, epoch=7, rounds_done=1, group_size=4)
        assert response.status_code == 202
    assert await averaging_alerts(app, client, run["id"]) == []
