"""The report fast path (server/api/fast_reports.py) answers exactly as the route would:
it takes only valid reports of peers verified recently, and hands everything else on."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
from fastapi import FastAPI

from server.api.fast_reports import ReportFastPath
from server.app import create_app
from tests.server.conftest import Api, JoinedPeer, client_for, make_settings, running


@pytest.fixture
async def cached_app(database_url: str) -> AsyncIterator[FastAPI]:
    settings = make_settings(database_url, peer_auth_cache_ttl_s=3600)
    async with running(create_app(settings)) as app:
        yield app


@pytest.fixture
async def setup(
    cached_app: FastAPI,
) -> AsyncIterator[tuple[httpx.AsyncClient, dict[str, Any], JoinedPeer]]:
    async with client_for(cached_app) as client:
        api = Api(client)
        run = await api.create_run()
        peer = await api.join(run["id"], (await api.create_join_token(run["id"]))["token"])
        # The first report goes through the route and leaves the peer in the cache.
        assert (await api.report(run["id"], peer, samples=1)).status_code == 202
        yield client, run, peer


async def _post(
    client: httpx.AsyncClient,
    url: str,
    body: bytes,
    headers: dict[str, str],
    content_type: str = "application/json",
) -> httpx.Response:
    return await client.post(url, content=body, headers={**headers, "Content-Type": content_type})


async def test_valid_reports_are_taken_and_stored(cached_app: FastAPI, setup: Any) -> None:
    client, run, peer = setup
    url = f"/api/v1/runs/{run['id']}/reports"
    for samples in (10, 20, 30):
        response = await _post(
            client,
            url,
            b'{"epoch": 3, "samples": %d, "samples_per_second": 2.5, "loss": 0.25, "group_size": 1,'
            b' "rounds_done": 2, "rounds_failed": 1, "failure": "AllreduceTimeout",'
            b' "eval_metric": %d}' % (samples, samples),
            peer.headers,
        )
        assert response.status_code == 202 and response.json() == {"status": "accepted"}
        assert response.headers["X-Swarmgrad-Coordinator"] == "1"
    await cached_app.state.report_buffer.flush()
    progress = (await client.get(f"/api/v1/runs/{run['id']}/progress")).json()
    assert progress["samples"] == 30 and progress["epoch"] == 3
    assert (progress["rounds_done"], progress["rounds_failed"]) == (6, 3)
    assert progress["eval_metric"] == 30 and progress["loss"] == 0.25
    assert progress["recent_group_sizes"] == [1, 1, 1]
    assert progress["epochs"][-1]["reports"] == 3
    metrics = (await client.get("/metrics")).text
    assert 'route="/api/v1/runs/{run_id}/reports",status="202"' in metrics


@pytest.mark.parametrize(
    "body",
    [
        b'{"epoch": -1, "samples": 0, "samples_per_second": 0}',
        b'{"epoch": 0, "samples": 0, "samples_per_second": 0, "loss": NaN}',
        b'{"epoch": 0, "samples": 0, "samples_per_second": 0, "extra": 1}',
        b'{"epoch": 0, "samples": 0, "samples_per_second": 0, "failure": "a b"}',
        b'{"epoch": 0, "samples": 0, "samples_per_second": 0, "rounds_done": -1}',
        b'{"epoch": 0, "samples": 0',
        b"[]",
    ],
)
async def test_invalid_bodies_get_the_route_s_422(setup: Any, body: bytes) -> None:
    client, run, peer = setup
    response = await _post(client, f"/api/v1/runs/{run['id']}/reports", body, peer.headers)
    assert response.status_code == 422
    assert response.json()["detail"][0]["msg"]


async def test_wrong_run_wrong_secret_and_other_content_types(setup: Any) -> None:
    client, run, peer = setup
    body = b'{"epoch": 0, "samples": 5, "samples_per_second": 1}'
    other = await Api(client).create_run("other")
    wrong_run = await _post(client, f"/api/v1/runs/{other['id']}/reports", body, peer.headers)
    assert wrong_run.status_code == 403 and "another run" in wrong_run.json()["detail"]
    token = peer.body["peer_token"]
    forged = {"Authorization": f"Bearer {token[:-2]}{'AA' if not token.endswith('AA') else 'BB'}"}
    assert (
        await _post(client, f"/api/v1/runs/{run['id']}/reports", body, forged)
    ).status_code == 401
    charset = await _post(
        client,
        f"/api/v1/runs/{run['id']}/reports",
        body,
        peer.headers,
        "application/json; charset=utf-8",
    )
    assert charset.status_code == 202
    text = await _post(
        client, f"/api/v1/runs/{run['id']}/reports", body, peer.headers, "text/plain"
    )
    assert text.status_code == 422  # the route refuses a non-JSON content type


async def test_fast_path_handles_cached_valid_reports_and_hands_on_the_rest(
    cached_app: FastAPI, setup: Any
) -> None:
    """Around an inner app that answers 599, only the requests the fast path owns get 202."""
    _, run, peer = setup
    inner_calls: list[bytes] = []

    async def inner(scope: Any, receive: Any, send: Any) -> None:
        message = await receive()
        inner_calls.append(message.get("body", b""))
        await send({"type": "http.response.start", "status": 599, "headers": []})
        await send({"type": "http.response.body", "body": b""})

    fast = ReportFastPath(inner)
    async with httpx.AsyncClient(
        transport=httpx.ASGITransport(app=_with_app(fast, cached_app)), base_url="http://x"
    ) as client:
        url = f"/api/v1/runs/{run['id']}/reports"
        good = b'{"epoch": 0, "samples": 7, "samples_per_second": 1}'
        assert (await _post(client, url, good, peer.headers)).status_code == 202
        assert inner_calls == []
        bad = b'{"epoch": -1, "samples": 7, "samples_per_second": 1}'
        assert (await _post(client, url, bad, peer.headers)).status_code == 599
        assert inner_calls == [bad]  # the body was replayed intact
        assert (await _post(client, url, good, {})).status_code == 599
        assert (await client.get(url, headers=peer.headers)).status_code == 599
    await cached_app.state.report_buffer.flush()
    async with client_for(cached_app) as client:
        progress = (await client.get(f"/api/v1/runs/{run['id']}/progress")).json()
    assert progress["samples"] == 7


def _with_app(asgi: Any, app: FastAPI) -> Any:
    async def wrapped(scope: Any, receive: Any, send: Any) -> None:
        scope["app"] = app
        await asgi(scope, receive, send)

    return wrapped
