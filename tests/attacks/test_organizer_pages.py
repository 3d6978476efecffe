"""Attacks on the organizer's pages and bans through a real coordinator process."""

from __future__ import annotations

import contextlib
import re

import httpx
import pytest

from server.web.security import CSRF_COOKIE
from tests.attacks.conftest import Attack, Coordinator

pytestmark = pytest.mark.slow

CSRF = re.compile(r'name="csrf" value="([^"]+)"')


def signed_in(coordinator: Coordinator) -> tuple[httpx.Client, str]:
    """An organizer's browser, signed in, and the CSRF field of its pages."""
    browser = httpx.Client(base_url=coordinator.url, timeout=30.0)
    field = CSRF.search(browser.get("/signin").text)
    assert field
    token = coordinator.organizer["Authorization"].removeprefix("Bearer ")
    answer = browser.post("/signin", data={"csrf": field.group(1), "token": token})
    assert answer.status_code == 303, answer.text
    again = CSRF.search(browser.get("/").text)
    assert again
    return browser, again.group(1)


def test_csrf_cookie_and_field_chosen_by_the_attacker(
    attack: Attack, coordinator: Coordinator
) -> None:
    """The organizer pages' CSRF token is a double-submit value not tied to the session"""
    run_id = coordinator.create_run()
    browser, field = signed_in(coordinator)
    with contextlib.closing(browser):
        browser.cookies.set(CSRF_COOKIE, "attacker-chosen")
        forged = browser.post(f"/runs/{run_id}/actions/finish", data={"csrf": "attacker-chosen"})
        assert forged.status_code == 403
        status = coordinator.http.get(f"/api/v1/runs/{run_id}", headers=coordinator.organizer)
        assert status.json()["status"] == "running"
        attack.outcome("a chosen cookie and field are refused with 403; the run keeps running")
        paused = browser.post(f"/runs/{run_id}/actions/pause", data={"csrf": field})
        assert paused.status_code == 303
        status = coordinator.http.get(f"/api/v1/runs/{run_id}", headers=coordinator.organizer)
        assert status.json()["status"] == "paused"
        attack.effect("the organizer's own form still works")


def test_banned_volunteer_returns_through_the_shared_invite(
    attack: Attack, coordinator: Coordinator
) -> None:
    """A banned volunteer comes back through the same shared invite with a new key"""
    run_id = coordinator.create_run()
    shared = coordinator.invite(run_id, label="shared")
    other = coordinator.invite(run_id, label="lab")
    coordinator.join(run_id, shared)
    volunteers = coordinator.http.get(f"/api/v1/runs/{run_id}/dashboard").json()["volunteers"]
    browser, field = signed_in(coordinator)
    with contextlib.closing(browser):
        banned = browser.post(
            f"/runs/{run_id}/volunteers/{volunteers[0]['id']}/ban", data={"csrf": field}
        )
        assert banned.status_code == 303
        page = browser.get(banned.headers["location"]).text
        offer = re.search(r'<div id="ban-offer".*?</div>', page, re.S)
        assert offer and "Revoke invite shared" in offer.group(0)
        revoke = re.search(r'action="(/runs/[^"]+/revoke)"', offer.group(0))
        assert revoke
        assert browser.post(revoke.group(1), data={"csrf": field}).status_code == 303
    attack.outcome("the ban offers to revoke the shared invite")
    back = coordinator.join(run_id, shared, expect=401)
    assert "revoked" in back.joined["detail"]
    attack.outcome("a new key through it is refused with 401")
    coordinator.join(run_id, other)
    attack.effect("volunteers with other invites still join")
