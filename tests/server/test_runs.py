"""Runs: create, list, read, change, archive — on SQLite and PostgreSQL."""

from __future__ import annotations

import base64

import httpx
from fastapi import FastAPI

from server.app import create_app
from server.config import Settings
from tests.server.conftest import ORGANIZER, Api


async def test_create_returns_the_run_with_its_public_key(client: httpx.AsyncClient) -> None:
    response = await client.post(
        "/api/v1/runs",
        json={
            "name": "cifar",
            "task": "resnet18",
            "config": {"lr": 0.05, "nested": [1, {"a": None}]},
        },
        headers=ORGANIZER,
    )
    assert response.status_code == 201
    run = response.json()
    assert run["name"] == "cifar" and run["task"] == "resnet18"
    assert run["config"] == {"lr": 0.05, "nested": [1, {"a": None}]}
    assert run["status"] == "running"
    assert run["archived_at"] is None
    assert len(base64.urlsafe_b64decode(run["public_key"])) == 32
    assert run["created_at"].endswith(("Z", "+00:00"))


async def test_list_and_read(api: Api, client: httpx.AsyncClient) -> None:
    first = await api.create_run("first")
    second = await api.create_run("second")
    listed = (await client.get("/api/v1/runs")).json()["runs"]
    assert {r["id"] for r in listed} == {first["id"], second["id"]}
    read = await client.get(f"/api/v1/runs/{first['id']}")
    # a single run's answer also carries its revocation list's serial (no bans: 0)
    assert first["revocations_serial"] is None
    assert read.status_code == 200 and read.json() == {**first, "revocations_serial": 0}


async def test_unknown_run_is_404_with_a_detail(client: httpx.AsyncClient) -> None:
    for method, path in [
        ("GET", "/api/v1/runs/nope"),
        ("PATCH", "/api/v1/runs/nope"),
        ("DELETE", "/api/v1/runs/nope"),
        ("GET", "/api/v1/runs/nope/progress"),
        ("GET", "/api/v1/runs/nope/tokens"),
        ("POST", "/api/v1/runs/nope/tokens"),
    ]:
        response = await client.request(method, path, json={}, headers=ORGANIZER)
        assert response.status_code == 404, (method, path, response.text)
        assert "nope" in response.json()["detail"]


async def test_pause_resume_finish(api: Api, client: httpx.AsyncClient) -> None:
    run = await api.create_run()
    url = f"/api/v1/runs/{run['id']}"
    paused = await client.patch(url, json={"status": "paused"}, headers=ORGANIZER)
    assert paused.status_code == 200 and paused.json()["status"] == "paused"
    resumed = await client.patch(
        url, json={"status": "running", "config": {"lr": 0.01}}, headers=ORGANIZER
    )
    assert resumed.json()["status"] == "running" and resumed.json()["config"] == {"lr": 0.01}
    assert resumed.json()["updated_at"] >= paused.json()["updated_at"]
    finished = await client.patch(url, json={"status": "finished"}, headers=ORGANIZER)
    assert finished.json()["status"] == "finished"
    reopened = await client.patch(url, json={"status": "running"}, headers=ORGANIZER)
    assert reopened.status_code == 409
    assert "finished" in reopened.json()["detail"]
    assert (await client.get(url)).json()["status"] == "finished"


async def test_invalid_bodies_are_422_with_details(api: Api, client: httpx.AsyncClient) -> None:
    run = await api.create_run()
    bad = [
        ("POST", "/api/v1/runs", {"task": "x"}),
        ("POST", "/api/v1/runs", {"name": "", "task": "x"}),
        ("POST", "/api/v1/runs", {"name": "a\x00b", "task": "x"}),
        ("POST", "/api/v1/runs", {"name": "a", "task": "x", "config": [1]}),
        ("POST", "/api/v1/runs", {"name": "a", "task": "x", "unknown": 1}),
        ("PATCH", f"/api/v1/runs/{run['id']}", {"status": "exploded"}),
    ]
    for method, path, body in bad:
        response = await client.request(method, path, json=body, headers=ORGANIZER)
        assert response.status_code == 422, (body, response.text)
        assert response.json()["detail"]


async def test_config_with_nan_is_refused(client: httpx.AsyncClient) -> None:
    response = await client.post(
        "/api/v1/runs",
        content=b'{"name": "a", "task": "b", "config": {"lr": NaN}}',
        headers={**ORGANIZER, "Content-Type": "application/json"},
    )
    assert response.status_code == 422
    assert "NaN" in str(response.json()["detail"])


async def test_archive_keeps_data_and_hides_from_list(api: Api, client: httpx.AsyncClient) -> None:
    run = await api.create_run()
    url = f"/api/v1/runs/{run['id']}"
    assert (await client.delete(url, headers=ORGANIZER)).status_code == 204
    assert (await client.delete(url, headers=ORGANIZER)).status_code == 204  # idempotent
    archived = (await client.get(url)).json()
    assert archived["archived_at"] is not None and archived["status"] == "finished"
    assert run["id"] not in {r["id"] for r in (await client.get("/api/v1/runs")).json()["runs"]}
    everything = (await client.get("/api/v1/runs", params={"include_archived": True})).json()
    assert run["id"] in {r["id"] for r in everything["runs"]}
    changed = await client.patch(url, json={"name": "again"}, headers=ORGANIZER)
    assert changed.status_code == 409 and "archived" in changed.json()["detail"]


async def test_healthz(client: httpx.AsyncClient) -> None:
    response = await client.get("/healthz")
    assert response.status_code == 200
    assert response.json() == {"status": "ok", "database": "ok"}


async def test_openapi_docs_are_served(client: httpx.AsyncClient) -> None:
    schema = (await client.get("/openapi.json")).json()
    assert "/api/v1/runs/{run_id}/join" in schema["paths"]
    assert (await client.get("/docs")).status_code == 200


async def test_unknown_route_and_method_answer_json(client: httpx.AsyncClient) -> None:
    missing = await client.get("/api/v1/nothing-here")
    assert missing.status_code == 404 and missing.json()["detail"]
    wrong_method = await client.put("/api/v1/runs")
    assert wrong_method.status_code == 405 and wrong_method.json()["detail"]


async def test_oversized_body_is_413(client: httpx.AsyncClient) -> None:
    huge = b'{"name": "a", "task": "b", "config": {"x": "' + b"x" * (2 * 1024 * 1024) + b'"}}'
    response = await client.post(
        "/api/v1/runs", content=huge, headers={**ORGANIZER, "Content-Type": "application/json"}
    )
    assert response.status_code == 413
    assert response.json()["detail"]


async def test_every_answer_says_it_comes_from_a_coordinator(
    client: httpx.AsyncClient, settings: Settings
) -> None:
    """Clients tell a coordinator from whatever else answers at a URL by this header: on
    successes, on every kind of error, and on a crash."""
    huge = b"x" * (2 * 1024 * 1024)
    answers = [
        await client.get("/healthz"),
        await client.get("/metrics"),
        await client.get("/api/v1/runs"),
        await client.get("/api/v1/nothing-here"),
        await client.put("/api/v1/runs"),
        await client.post("/api/v1/runs", json={}),
        await client.post("/api/v1/runs", json={}, headers=ORGANIZER),
        await client.post("/api/v1/runs", json={"name": "n", "task": "t"}, headers=ORGANIZER),
        await client.post("/api/v1/runs", json={"name": "n", "task": "t"}),
        await client.post("/api/v1/runs", content=huge, headers=ORGANIZER),
    ]
    assert [a.status_code for a in answers] == [200, 200, 200, 404, 405, 401, 422, 201, 401, 413]
    for answer in answers:
        assert answer.headers["X-Swarmgrad-Coordinator"] == "1", answer.request.url

    app: FastAPI = create_app(settings)

    async def boom() -> None:
        raise RuntimeError("a bug")

    app.add_api_route("/boom", boom)
    transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
    async with httpx.AsyncClient(transport=transport, base_url="http://c") as crashing:
        crashed = await crashing.get("/boom")
    assert crashed.status_code == 500 and crashed.headers["X-Swarmgrad-Coordinator"] == "1"
