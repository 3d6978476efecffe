"""A swarm that cannot average is flagged on a live dashboard within 30 s, with the reason
and what helps: three volunteers in client mode (nobody can dial anyone) report rounds that
found no group, through the API, while the page is open in a real browser."""

from __future__ import annotations

import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from peer.formats.identity import Identity
from server.app import create_app
from server.services.averaging_health import NO_GROUP_ROUNDS
from tests.conftest import served
from tests.server.conftest import ORGANIZER, bearer, join_proof, make_settings
from tests.web.conftest import settled

FLAG_WITHIN_S = 30.0  # what a volunteer's organizer is promised


@pytest.fixture
def coordinator() -> Iterator[str]:
    with tempfile.TemporaryDirectory() as directory:
        settings = make_settings(
            f"sqlite:///{directory}/coordinator.db",
            checkpoint_dir=Path(directory) / "checkpoints",
            report_flush_interval_s=0,
        )
        with served(create_app(settings)) as url:
            yield url


def client_mode_peer(client: httpx.Client, run_id: str, invite: str, name: str) -> str:
    """A volunteer the coordinator could not reach and that punches nowhere: its token."""
    challenge = client.post("/api/v1/join/challenge", headers=bearer(invite)).json()["challenge"]
    body: dict[str, Any] = {
        **join_proof(run_id, challenge, Identity()),
        "addresses": [],
        "client_mode": True,
        "display_name": name,
    }
    answer = client.post(f"/api/v1/runs/{run_id}/join", json=body, headers=bearer(invite))
    assert answer.status_code == 200, answer.text
    return str(answer.json()["peer_token"])


def test_a_swarm_of_unreachable_volunteers_is_flagged_within_30_s(
    coordinator: str, open_page: Any
) -> None:
    with httpx.Client(base_url=coordinator) as client:
        run = client.post(
            "/api/v1/runs",
            json={"name": "homes", "task": "digits", "config": {"epochs": 50}},
            headers=ORGANIZER,
        ).json()
        invite = client.post(
            f"/api/v1/runs/{run['id']}/tokens", json={"label": "homes"}, headers=ORGANIZER
        ).json()["token"]
        tokens = [client_mode_peer(client, run["id"], invite, n) for n in ("ann", "ben", "cat")]

        def report(token: str, **body: Any) -> None:
            payload = {"samples": 100, "samples_per_second": 10.0, "loss": 1.0, **body}
            answer = client.post(
                f"/api/v1/runs/{run['id']}/reports", json=payload, headers=bearer(token)
            )
            assert answer.status_code == 202, answer.text

        for token in tokens:  # one round without a group: too early to say
            report(token, epoch=1, rounds_failed=1)
        page = open_page(f"{coordinator}/runs/{run['id']}")
        settled(page)
        flag = page.locator("#alerts [data-alert=not_averaging]")
        assert flag.count() == 0

        for token in tokens:  # the rounds go on failing: the swarm cannot average
            report(token, epoch=NO_GROUP_ROUNDS, rounds_failed=NO_GROUP_ROUNDS - 1)
        began = time.monotonic()
        flag.wait_for(timeout=FLAG_WITHIN_S * 1000)
        print(f"flagged {time.monotonic() - began:.1f} s after the condition")
        text = flag.inner_text()
        assert "3 volunteers online" in text and "none of them can be reached" in text
        assert "forward a port" in flag.locator(".alert-help").inner_text()
        assert "docs/deploy.md" in text

        # the same page, loaded afresh, says it from the server-side render
        again = open_page(f"{coordinator}/runs/{run['id']}")
        settled(again)
        assert (
            "none of them can be reached"
            in again.locator("#alerts [data-alert=not_averaging]").inner_text()
        )
