"""Two coordinator processes on one PostgreSQL database, as a deployment with several workers
runs: a browser on the first worker's dashboard sees what peers report to the second."""

from __future__ import annotations

import re
import secrets
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from peer.formats.identity import Identity
from swarmgrad.local import LocalCoordinator
from swarmlab.node_process import wait_until
from tests.conftest import scaled
from tests.server.conftest import bearer, fresh_database, join_proof

pytestmark = [pytest.mark.slow, pytest.mark.postgres]


@pytest.fixture
def workers(tmp_path: Path) -> Iterator[tuple[LocalCoordinator, LocalCoordinator, str]]:
    """Both workers, and the organizer token they share."""
    admin = secrets.token_urlsafe(32)
    with fresh_database("postgresql", tmp_path) as url:
        shared = {
            "SWARMGRAD_DATABASE_URL": url,
            "SWARMGRAD_SECRET_KEY": secrets.token_urlsafe(48),
            "SWARMGRAD_ADMIN_TOKEN": admin,
            "SWARMGRAD_CHECKPOINT_DIR": str(tmp_path / "checkpoints"),
            "SWARMGRAD_SNAPSHOT_INTERVAL_S": "1",
        }
        one = LocalCoordinator(tmp_path / "one", env=shared)
        two = LocalCoordinator(tmp_path / "two", env=shared)
        with one, two:
            yield one, two, admin


def test_a_browser_on_one_worker_sees_reports_sent_to_the_other(
    workers: tuple[LocalCoordinator, LocalCoordinator, str], open_page: object
) -> None:
    one, two, admin = workers
    organizer = bearer(admin)
    with httpx.Client(base_url=two.url, timeout=10) as client:
        run = client.post(
            "/api/v1/runs", json={"name": "workers", "task": "digits"}, headers=organizer
        ).json()
        invite = client.post(f"/api/v1/runs/{run['id']}/tokens", json={}, headers=organizer)
        token = invite.json()["token"]
        challenge = client.post("/api/v1/join/challenge", headers=bearer(token)).json()
        body = {**join_proof(run["id"], challenge["challenge"], Identity()), "addresses": []}
        body |= {"client_mode": True, "display_name": "far away"}
        peer = client.post(f"/api/v1/runs/{run['id']}/join", json=body, headers=bearer(token))
        peer_token = peer.json()["peer_token"]

        page = open_page(f"{one.url}/runs/{run['id']}")  # type: ignore[operator]
        page.locator("#live-status[data-state=live]").wait_for(timeout=scaled(20) * 1000)
        samples = page.locator("[data-metric=samples]")
        for step in range(1, 4):
            report = {"epoch": step, "samples": 1000 * step, "samples_per_second": 50.0}
            answer = client.post(
                f"/api/v1/runs/{run['id']}/reports", json=report, headers=bearer(peer_token)
            )
            assert answer.status_code == 202
            expected = 1000 * step
            assert wait_until(
                lambda n=expected: int(re.sub(r"\D", "", samples.inner_text())) == n, scaled(10)
            ), (step, samples.inner_text())
        assert "far away" in page.locator("#volunteers").inner_text()
