"""The pages of a running swarm, in a real browser: a coordinator process and real
``swarmgrad join`` volunteers, as people run them. The tests of this module share one swarm
and run in order (the last ones pause it, then stop the coordinator)."""

from __future__ import annotations

import os
import re
import signal
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

from peer.formats.identity import Identity
from swarmgrad.local import LocalCoordinator, start_volunteer, stop_processes
from swarmlab.node_process import wait_until
from tests.conftest import scaled
from tests.server.conftest import bearer, join_proof
from tests.web.conftest import expect_network_errors

# alone: they hold presence and live updates to wall-clock bounds (offline within 25 s)
pytestmark = [pytest.mark.slow, pytest.mark.alone]

# Epochs of 8192 samples: a volunteer that trains alone before the other one is found
# (it does not wait for a group) covers a few epochs, not hundreds, before they average.
CONFIG = {"epochs": 100000, "matchmaking_time": 0.5, "target_batch_size": 8192}


@dataclass
class Swarm:
    coordinator: LocalCoordinator
    run_id: str
    directory: Path
    processes: list[Any] = field(default_factory=list)

    @property
    def url(self) -> str:
        return self.coordinator.url

    @property
    def dashboard(self) -> str:
        return f"{self.url}/runs/{self.run_id}"

    def organizer(self) -> dict[str, str]:
        return bearer(self.coordinator.admin_token)

    def volunteer(self, token: str, name: str) -> None:
        with open(self.directory / f"{name}.log", "w") as log:  # the child keeps its copy
            process = start_volunteer(
                self.url,
                token,
                self.directory / name,
                "--quiet",
                "--name",
                name,
                "--verbose",
                "--host",
                "127.0.0.1",
                stdout=log,
                env={"OMP_NUM_THREADS": "1", "PYTHONFAULTHANDLER": "1"},
            )
        self.processes.append(process)

    def logs(self) -> str:
        """For a failing assertion: every volunteer's stacks (``swarmgrad`` prints them on
        SIGUSR1) and the end of its log, and the end of the coordinator's log."""
        paths = sorted(self.directory.glob("*.log"))
        for process in self.processes:
            if process.poll() is None:
                os.kill(process.pid, signal.SIGUSR1)
        wait_until(
            lambda: all(
                "most recent call first" in path.read_text(errors="replace") for path in paths
            ),
            scaled(10),
        )
        return "\n".join(
            f"--- {path.name}\n{path.read_text(errors='replace')[-12000:]}"
            for path in [*paths, self.coordinator.log_path]
            if path.exists()
        )

    def document(self) -> dict[str, Any]:
        answer = httpx.get(f"{self.url}/api/v1/runs/{self.run_id}/dashboard", timeout=10)
        answer.raise_for_status()
        return answer.json()


@pytest.fixture(scope="module")
def swarm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Swarm]:
    directory = tmp_path_factory.mktemp("swarm")
    coordinator = LocalCoordinator(
        directory / "coordinator",
        env={"SWARMGRAD_SNAPSHOT_INTERVAL_S": "1", "SWARMGRAD_REPORT_INTERVAL_S": "1"},
    )
    coordinator.start()
    try:
        with httpx.Client(base_url=coordinator.url, headers=bearer(coordinator.admin_token)) as c:
            run = c.post(
                "/api/v1/runs", json={"name": "browser", "task": "digits", "config": CONFIG}
            ).json()
            swarm = Swarm(coordinator, run["id"], directory)
            for name in ("ada", "bob"):
                invite = c.post(f"/api/v1/runs/{run['id']}/tokens", json={"max_uses": 1}).json()
                swarm.volunteer(invite["token"], name)
        try:
            yield swarm
        finally:
            stop_processes(swarm.processes)
    finally:
        coordinator.stop()


def sign_in(page: Any, swarm: Swarm) -> None:
    page.goto(f"{swarm.url}/signin?next=/runs/{swarm.run_id}")
    page.get_by_label("Organizer token").fill(swarm.coordinator.admin_token)
    page.get_by_role("button", name="Sign in").click()
    page.wait_for_url(f"**/runs/{swarm.run_id}")


def metric(page: Any, name: str) -> int:
    return int(re.sub(r"\D", "", page.locator(f"[data-metric={name}]").inner_text()) or 0)


def test_the_dashboard_moves_without_reload(swarm: Swarm, open_page: Any) -> None:
    page = open_page(swarm.dashboard)
    page.locator("#live-status[data-state=live]").wait_for(timeout=scaled(20) * 1000)
    assert wait_until(lambda: metric(page, "samples") > 0, scaled(90)), swarm.logs()
    epoch, samples = metric(page, "epoch"), metric(page, "samples")
    navigations = page.evaluate("performance.getEntriesByType('navigation').length")
    assert wait_until(
        lambda: metric(page, "epoch") > epoch and metric(page, "samples") > samples, scaled(90)
    ), (epoch, samples, swarm.document()["headline"], swarm.logs())
    assert page.evaluate("performance.getEntriesByType('navigation').length") == navigations
    assert page.locator("#volunteers tr[data-volunteer-id]").count() == 2
    assert wait_until(lambda: metric(page, "peers_online") == 2, scaled(30))


def test_an_invite_from_the_page_brings_a_volunteer_into_the_table(
    swarm: Swarm, open_page: Any
) -> None:
    organizer = open_page(swarm.url)
    sign_in(organizer, swarm)
    organizer.get_by_label("Uses").fill("1")
    organizer.get_by_role("button", name="Create invite").click()
    link = organizer.locator("#invite-link").inner_text().strip()
    assert link.startswith(f"{swarm.url}/join/")

    volunteer = open_page(link)  # another browser context: nothing shared with the organizer
    volunteer.get_by_label("Display name").fill("carol")
    volunteer.get_by_role("button", name="Get my credential").click()
    command = volunteer.locator("#join-command").inner_text().strip()
    token = volunteer.locator("#credential").inner_text().strip()
    assert command == f"swarmgrad join {swarm.url} --token {token}"

    swarm.volunteer(token, "carol-laptop")
    row = organizer.locator("#volunteers tr[data-volunteer-id]", has_text="carol")
    row.wait_for(timeout=scaled(60) * 1000)  # live: the organizer's page was not reloaded
    assert wait_until(lambda: "online" in row.inner_text(), scaled(60))
    again = open_page(link)  # another browser: the invite is spent (410)
    expect_network_errors(again)
    assert "used up" in again.get_by_role("alert").inner_text()


def test_a_stopped_volunteer_shows_offline_within_25_s(swarm: Swarm, open_page: Any) -> None:
    page = open_page(swarm.dashboard)
    row = page.locator("#volunteers tr[data-volunteer-id]", has_text="carol")
    row.locator(".badge-running").wait_for(timeout=scaled(60) * 1000)
    online = metric(page, "peers_online")
    carol = next(p for p in swarm.processes if any("carol-laptop" in str(a) for a in p.args))
    carol.send_signal(signal.SIGINT)  # Ctrl-C: it leaves the run and exits
    carol.wait(scaled(30))
    gone = time.monotonic()
    row.locator(".badge-running").wait_for(state="detached", timeout=scaled(45) * 1000)
    assert time.monotonic() - gone <= scaled(25), swarm.logs()
    assert wait_until(lambda: metric(page, "peers_online") == online - 1, scaled(5))


def test_ban_from_the_page_stops_renewal(swarm: Swarm, open_page: Any) -> None:
    with httpx.Client(base_url=swarm.url) as client:
        invite = client.post(
            f"/api/v1/runs/{swarm.run_id}/tokens", json={}, headers=swarm.organizer()
        ).json()["token"]
        page = open_page(f"{swarm.url}/join/{invite}")
        page.get_by_label("Display name").fill("mallory")
        page.get_by_role("button", name="Get my credential").click()
        personal = page.locator("#credential").inner_text().strip()
        challenge = client.post("/api/v1/join/challenge", headers=bearer(personal)).json()
        body = {**join_proof(swarm.run_id, challenge["challenge"], Identity()), "addresses": []}
        body["client_mode"] = True
        joined = client.post(
            f"/api/v1/runs/{swarm.run_id}/join", json=body, headers=bearer(personal)
        ).json()
        renew = f"/api/v1/runs/{swarm.run_id}/certificate"
        assert client.post(renew, headers=bearer(joined["peer_token"])).status_code == 200

        sign_in(page, swarm)
        page.get_by_role("button", name="Ban mallory").click()
        page.locator("#volunteers tr", has_text="mallory").locator(".badge-banned").wait_for()
        assert client.post(renew, headers=bearer(joined["peer_token"])).status_code == 401
        assert client.post("/api/v1/join/challenge", headers=bearer(personal)).status_code == 401


def test_revoking_an_invite_from_the_page(swarm: Swarm, open_page: Any) -> None:
    page = open_page(swarm.url)
    sign_in(page, swarm)
    page.get_by_label("Label").fill("to revoke")
    page.get_by_role("button", name="Create invite").click()
    link = page.locator("#invite-link").inner_text().strip()
    page.locator("#invites tr", has_text="to revoke").get_by_role("button", name="Revoke").click()
    page.wait_for_load_state()
    assert page.locator("#invites tr", has_text="to revoke").count() == 0
    revoked = open_page(link)
    expect_network_errors(revoked)  # 410: the browser logs it
    assert revoked.get_by_role("alert").inner_text() == "This invite was revoked."


def test_pause_stops_the_peers_and_resume_restarts_them(swarm: Swarm, open_page: Any) -> None:
    page = open_page(swarm.url)
    sign_in(page, swarm)
    page.get_by_role("button", name="Pause").click()
    page.locator("#run-status", has_text="paused").wait_for()
    rate = page.locator("[data-metric=samples_per_second]")
    assert rate.inner_text() == "0 (paused)"
    assert page.get_by_role("button", name="Pause").is_disabled()

    def samples() -> int:
        return int(swarm.document()["headline"]["samples"])

    # Peers obey at their next status poll; once they have, the total stays put.
    def flat() -> bool:
        before = samples()
        return not wait_until(lambda: samples() > before, scaled(8))

    assert wait_until(flat, scaled(60)), "the peers kept training while paused"
    paused_at = samples()
    page.get_by_role("button", name="Resume").click()
    page.locator("#run-status", has_text="running").wait_for()
    assert wait_until(lambda: samples() > paused_at, scaled(90)), (
        f"training did not resume\n{swarm.logs()}"
    )


def test_the_page_says_reconnecting_and_catches_up(swarm: Swarm, open_page: Any) -> None:
    page = open_page(swarm.dashboard)
    status = page.locator("#live-status")
    page.locator("#live-status[data-state=live]").wait_for(timeout=scaled(20) * 1000)
    expect_network_errors(page)
    swarm.coordinator.stop()
    page.locator("#live-status[data-state=reconnecting]").wait_for(timeout=scaled(20) * 1000)
    assert status.inner_text() == "Reconnecting…"
    before = metric(page, "samples")
    swarm.coordinator.start()
    page.locator("#live-status[data-state=live]").wait_for(timeout=scaled(60) * 1000)
    assert wait_until(lambda: metric(page, "samples") > before, scaled(90)), swarm.logs()
