"""Live updates: what a WebSocket subscriber receives, and that two workers on one database
need nothing from each other — a subscriber of one sees reports sent to the other."""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from websockets.exceptions import ConnectionClosed
from websockets.sync.client import ClientConnection, connect

from peer.formats.identity import Identity
from server.app import create_app
from tests.conftest import scaled, served
from tests.server.conftest import ORGANIZER, bearer, fresh_database, join_proof, make_settings


@pytest.fixture
def workers(tmp_path: Path) -> Iterator[tuple[httpx.Client, httpx.Client]]:
    """Two coordinator apps served on two ports (as two worker processes would be), one
    PostgreSQL database."""
    with contextlib.ExitStack() as stack:
        url = stack.enter_context(fresh_database("postgresql", tmp_path))
        settings = make_settings(url, checkpoint_dir=tmp_path / "checkpoints")
        clients = [
            stack.enter_context(
                httpx.Client(base_url=stack.enter_context(served(create_app(settings))))
            )
            for _ in range(2)
        ]
        yield clients[0], clients[1]


def live(client: httpx.Client, path: str) -> ClientConnection:
    return connect(str(client.base_url).replace("http://", "ws://").rstrip("/") + path)


def join(client: httpx.Client, run_id: str, invite: str) -> dict[str, Any]:
    challenge = client.post("/api/v1/join/challenge", headers=bearer(invite)).json()["challenge"]
    body = {**join_proof(run_id, challenge, Identity()), "addresses": ["ws://127.0.0.1:9"]}
    response = client.post(f"/api/v1/runs/{run_id}/join", json=body, headers=bearer(invite))
    assert response.status_code == 200, response.text
    return response.json()


def receive_until(websocket: ClientConnection, predicate: Any, timeout: float) -> dict[str, Any]:
    """Frames until one satisfies ``predicate`` (pings are skipped)."""
    deadline = time.monotonic() + timeout
    while (left := deadline - time.monotonic()) > 0:
        frame = json.loads(websocket.recv(timeout=left))
        if frame["type"] != "ping" and predicate(frame):
            return frame
    raise AssertionError(f"no matching frame within {timeout} s")


@pytest.mark.postgres
def test_a_subscriber_of_one_worker_sees_reports_sent_to_another(
    workers: tuple[httpx.Client, httpx.Client],
) -> None:
    one, two = workers
    run = one.post(
        "/api/v1/runs", json={"name": "live", "task": "t", "config": {}}, headers=ORGANIZER
    ).json()
    invite = one.post(f"/api/v1/runs/{run['id']}/tokens", json={}, headers=ORGANIZER).json()
    peer = join(two, run["id"], invite["token"])

    with live(one, f"/api/v1/runs/{run['id']}/live") as websocket:
        first = json.loads(websocket.recv(timeout=scaled(10)))
        assert first["type"] == "dashboard" and first["data"]["headline"]["samples"] == 0
        for samples in (64, 128):
            report = {"epoch": 1, "samples": samples, "samples_per_second": 5.0}
            answer = two.post(
                f"/api/v1/runs/{run['id']}/reports", json=report, headers=bearer(peer["peer_token"])
            )
            assert answer.status_code == 202
            frame = receive_until(
                websocket,
                lambda f, n=samples: f["data"]["headline"]["samples"] == n,
                scaled(10),
            )
            assert frame["data"]["headline"]["peers_online"] == 1

    with live(one, "/api/v1/live") as websocket:
        frame = json.loads(websocket.recv(timeout=scaled(10)))
        assert frame["type"] == "runs"
        assert [r["samples"] for r in frame["data"]["runs"] if r["id"] == run["id"]] == [128]


@pytest.mark.postgres
def test_an_unknown_run_closes_the_socket_with_4404(
    workers: tuple[httpx.Client, httpx.Client],
) -> None:
    one, _ = workers
    with live(one, "/api/v1/runs/nosuchrun/live") as websocket:
        with pytest.raises(ConnectionClosed) as closed:
            websocket.recv(timeout=scaled(10))
    assert closed.value.rcvd is not None and closed.value.rcvd.code == 4404
