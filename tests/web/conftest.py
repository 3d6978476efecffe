"""Browser tests: Debian's chromium driven headless through playwright (never a downloaded
browser), against real coordinator and volunteer processes.

- ``browser``: one chromium for the session. Without ``/usr/bin/chromium`` the tests fail under
  ``CI=true`` (``make test`` installs it) and are skipped elsewhere, with the reason.
- ``open_page``: a page in a fresh context; every console error, page error or CSP violation
  fails the test (a test that expects network errors, e.g. while the coordinator is down, says
  so with ``expect_network_errors``); a screenshot of each page is kept under
  ``$SWARMGRAD_TEST_ARTIFACTS/screenshots`` (default ``test-artifacts/``).
- ``settled(page)``: the page loaded, its live feed (where it has one) connected, its fonts
  in and its layout done: the moment to measure or audit it.
- ``axe_violations(page)``: axe-core's serious and critical findings on the page.
- ``site``: an in-process coordinator with one run, three volunteers (one with a hostile
  name) and five reports each, shared by a module's tests.
"""

from __future__ import annotations

import os
import re
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

from peer.formats.identity import Identity
from server.app import create_app
from tests.conftest import served
from tests.server.conftest import ORGANIZER, bearer, join_proof, make_settings

CHROMIUM = Path("/usr/bin/chromium")
REPO_ROOT = Path(__file__).resolve().parents[2]
AXE = Path(__file__).parent / "vendor" / "axe-core" / "axe.min.js"
AXE_URL_PATH = "/__tests__/axe.min.js"  # served to the page by the test, same origin
ARTIFACTS = Path(os.environ.get("SWARMGRAD_TEST_ARTIFACTS", REPO_ROOT / "test-artifacts"))
NETWORK_ERROR = re.compile(r"WebSocket connection|Failed to load resource|net::ERR_")


def _require_chromium() -> None:
    if CHROMIUM.exists():
        return
    message = f"the browser tests need Debian's chromium at {CHROMIUM} (make test installs it)"
    if os.environ.get("CI", "").lower() == "true":
        pytest.fail(message, pytrace=False)
    pytest.skip(message)


@pytest.fixture(scope="session")
def browser() -> Iterator[Any]:
    _require_chromium()
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        chromium = playwright.chromium.launch(
            executable_path=str(CHROMIUM), args=["--no-sandbox"], headless=True
        )
        try:
            yield chromium
        finally:
            chromium.close()


@dataclass
class PageLog:
    errors: list[str] = field(default_factory=list)
    network_errors_expected: bool = False

    def unexpected(self) -> list[str]:
        if not self.network_errors_expected:
            return self.errors
        return [e for e in self.errors if not NETWORK_ERROR.search(e)]


def expect_network_errors(page: Any) -> None:
    """The coordinator will be unreachable for a while: its connection errors are expected."""
    page.swarmgrad_log.network_errors_expected = True


@pytest.fixture
def open_page(browser: Any, request: pytest.FixtureRequest) -> Iterator[Callable[..., Any]]:
    """``open_page(url, width=1366, height=768)``: a new page showing ``url`` (the answer to
    its navigation in ``page.swarmgrad_response``)."""
    opened: list[tuple[Any, Any, PageLog]] = []

    def open_(url: str, *, width: int = 1366, height: int = 768) -> Any:
        context = browser.new_context(viewport={"width": width, "height": height})
        context.route(f"**{AXE_URL_PATH}", lambda route: route.fulfill(path=str(AXE)))
        page = context.new_page()
        log = PageLog()
        page.swarmgrad_log = log
        page.on("console", lambda m: m.type == "error" and log.errors.append(m.text))
        page.on("pageerror", lambda e: log.errors.append(f"page error: {e}"))
        page.on("dialog", lambda d: (log.errors.append(f"dialog: {d.message}"), d.dismiss()))
        page.swarmgrad_response = page.goto(url)  # the navigation's answer (status, headers)
        opened.append((context, page, log))
        return page

    yield open_
    shots = ARTIFACTS / "screenshots"
    shots.mkdir(parents=True, exist_ok=True)
    name = re.sub(r"[^A-Za-z0-9_.-]+", "_", request.node.name)
    problems = []
    for i, (context, page, log) in enumerate(opened):
        try:
            page.screenshot(path=str(shots / f"{name}-{i}.png"), full_page=True)
        except Exception as exc:  # a page that crashed still lets the others be kept
            problems.append(f"no screenshot: {exc}")
        problems += log.unexpected()
        context.close()
    assert not problems, problems


def settled(page: Any) -> None:
    """Wait until ``page`` is what a person would look at: loaded (its scripts have run), its
    live feed saying "Live" where it has one, its web fonts in, and two frames drawn after that.

    Not playwright's "networkidle": a live page keeps talking to the coordinator, so a quiet
    network is a matter of luck, not a state of the page."""
    page.wait_for_load_state("load")
    if page.locator("#live-status").count():
        page.locator("#live-status[data-state=live]").wait_for()
    page.evaluate(
        """() => document.fonts.ready.then(() => new Promise(
               done => requestAnimationFrame(() => requestAnimationFrame(done))))"""
    )


def axe_violations(page: Any) -> list[dict[str, Any]]:
    """axe-core's serious and critical violations on ``page`` (loaded from this origin, as
    the Content-Security-Policy requires)."""
    origin = re.match(r"https?://[^/]+", page.url)
    assert origin is not None
    page.add_script_tag(url=origin.group(0) + AXE_URL_PATH)
    result = page.evaluate("async () => await axe.run(document, {resultTypes: ['violations']})")
    return [
        {"id": v["id"], "impact": v["impact"], "nodes": [n["html"] for n in v["nodes"][:3]]}
        for v in result["violations"]
        if v["impact"] in ("serious", "critical")
    ]


XSS = "<img src=x onerror=alert(1)>"


@dataclass
class Site:
    url: str
    run_id: str
    invite: str
    volunteer_id: int


def join(client: httpx.Client, run_id: str, token: str, name: str | None = None) -> dict[str, Any]:
    challenge = client.post("/api/v1/join/challenge", headers=bearer(token)).json()["challenge"]
    body: dict[str, Any] = {
        **join_proof(run_id, challenge, Identity()),
        "addresses": ["ws://127.0.0.1:9"],
    }
    if name is not None:
        body["display_name"] = name
    answer = client.post(f"/api/v1/runs/{run_id}/join", json=body, headers=bearer(token))
    assert answer.status_code == 200, answer.text
    return answer.json()


@pytest.fixture(scope="module")
def site() -> Iterator[Site]:
    with tempfile.TemporaryDirectory() as directory:
        settings = make_settings(
            f"sqlite:///{directory}/coordinator.db",
            checkpoint_dir=Path(directory) / "checkpoints",
            snapshot_interval_s=0.001,
            report_flush_interval_s=0,
        )
        with served(create_app(settings)) as url, httpx.Client(base_url=url) as client:
            run = client.post(
                "/api/v1/runs",
                json={"name": f"digits {XSS}", "task": "digits", "config": {"epochs": 50}},
                headers=ORGANIZER,
            ).json()
            invite = client.post(
                f"/api/v1/runs/{run['id']}/tokens", json={"label": XSS}, headers=ORGANIZER
            ).json()["token"]
            peers = [join(client, run["id"], invite, name) for name in (XSS, "ada", "bob")]
            for step in range(1, 6):
                for i, peer in enumerate(peers):
                    report = {
                        "epoch": step,
                        "samples": 100 * step * (i + 1),
                        "samples_per_second": 20.0 + i,
                        "loss": 2.0 / step,
                        "group_size": 3,
                        "rounds_done": 1,
                    }
                    answer = client.post(
                        f"/api/v1/runs/{run['id']}/reports",
                        json=report,
                        headers=bearer(peer["peer_token"]),
                    )
                    assert answer.status_code == 202
            dashboard = client.get(f"/api/v1/runs/{run['id']}/dashboard").json()
            xss_id = next(v["id"] for v in dashboard["volunteers"] if v["display_name"] == XSS)
            yield Site(url, run["id"], invite, xss_id)
