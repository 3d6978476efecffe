"""The volunteers' table in a real browser, one page at a time: the page shows the first page
the live feed carries, asks the coordinator for the others, sorts and filters there, keeps a
page other than the first live, and pages without JavaScript too."""

from __future__ import annotations

import re
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from server.app import create_app
from swarmlab.node_process import wait_until
from tests.conftest import scaled, served
from tests.server.conftest import ORGANIZER, bearer, make_settings
from tests.web.conftest import axe_violations, join

VOLUNTEERS = 60  # two pages of the default 50


@dataclass
class Swarm:
    url: str
    run_id: str
    tokens: dict[str, str]  # display name -> peer token

    @property
    def dashboard(self) -> str:
        return f"{self.url}/runs/{self.run_id}"

    def report(self, name: str, samples: int) -> None:
        answer = httpx.post(
            f"{self.url}/api/v1/runs/{self.run_id}/reports",
            json={"epoch": 1, "samples": samples, "samples_per_second": 1.0},
            headers=bearer(self.tokens[name]),
        )
        assert answer.status_code == 202, answer.text


@pytest.fixture(scope="module")
def swarm() -> Iterator[Swarm]:
    with tempfile.TemporaryDirectory() as directory:
        settings = make_settings(
            f"sqlite:///{directory}/coordinator.db",
            checkpoint_dir=Path(directory) / "checkpoints",
            report_flush_interval_s=0,
        )
        with served(create_app(settings)) as url, httpx.Client(base_url=url) as client:
            run = client.post(
                "/api/v1/runs", json={"name": "paged", "task": "digits"}, headers=ORGANIZER
            ).json()
            invite = client.post(
                f"/api/v1/runs/{run['id']}/tokens", json={"max_uses": VOLUNTEERS}, headers=ORGANIZER
            ).json()["token"]
            tokens = {
                f"v{i:02d}": join(client, run["id"], invite, f"v{i:02d}")["peer_token"]
                for i in range(VOLUNTEERS)
            }
            swarm = Swarm(url, run["id"], tokens)
            for i in range(VOLUNTEERS):  # v59 has the most samples, v00 the fewest
                swarm.report(f"v{i:02d}", i + 1)
            yield swarm


def names(page: Any) -> list[str]:
    # Read in one go: a live update may rebuild the table between two look-ups.
    return list(
        page.evaluate(
            "() => [...document.querySelectorAll('#volunteers tr[data-volunteer-id] th a')]"
            ".map(a => a.textContent)"
        )
    )


def shows(page: Any, expected: list[str]) -> bool:
    return wait_until(lambda: names(page) == expected, scaled(10))


def position(page: Any) -> str:
    return str(page.locator("#volunteers-position").inner_text())


def test_pages_come_from_the_coordinator_and_stay_live(swarm: Swarm, open_page: Any) -> None:
    page = open_page(swarm.dashboard)
    first = [f"v{i:02d}" for i in range(59, 9, -1)]
    assert shows(page, first)
    assert re.fullmatch(r"Page 1 of 2: 60 volunteers, \d+ online", position(page))
    assert page.locator("#volunteers-previous").is_hidden()
    page.locator("#volunteers-next").click()
    assert shows(page, [f"v{i:02d}" for i in range(9, -1, -1)])
    assert position(page).startswith("Page 2 of 2")
    assert page.locator("#volunteers-next").is_hidden()
    assert page.url == swarm.dashboard  # paged in place, not reloaded

    # Still live on page 2: v00 overtakes everyone and moves to page 1.
    swarm.report("v00", 500)
    assert shows(page, [f"v{i:02d}" for i in range(10, 0, -1)]), names(page)
    page.locator("#volunteers-previous").click()
    assert shows(page, ["v00", *first[:-1]])
    assert axe_violations(page) == []


def test_sorting_and_filtering_happen_on_the_server(swarm: Swarm, open_page: Any) -> None:
    page = open_page(swarm.dashboard)
    page.get_by_label("Find a volunteer by name").fill("V1")  # any case
    assert shows(page, [f"v{i}" for i in range(19, 9, -1)])
    assert re.fullmatch(r"Page 1 of 1: 10 matching of 60, \d+ online", position(page))
    name = page.locator("#volunteers button.sort[data-key=display_name]")
    name.click()
    assert shows(page, [f"v{i}" for i in range(10, 20)])
    assert name.locator("xpath=..").get_attribute("aria-sort") == "ascending"
    name.click()
    assert shows(page, [f"v{i}" for i in range(19, 9, -1)])
    assert name.locator("xpath=..").get_attribute("aria-sort") == "descending"
    page.get_by_label("Find a volunteer by name").fill("nobody")
    page.locator("#volunteers td", has_text="No volunteer's name matches.").wait_for()


def test_the_pager_works_without_javascript(swarm: Swarm, browser: Any) -> None:
    context = browser.new_context(java_script_enabled=False)
    try:
        page = context.new_page()
        page.goto(swarm.dashboard)
        rows = page.locator("#volunteers tr[data-volunteer-id]")
        assert rows.count() == 50
        page.locator("#volunteers-next").click()
        page.wait_for_url("**page=2**")
        assert rows.count() == VOLUNTEERS - 50
        page.get_by_label("Find a volunteer by name").fill("v2")
        page.get_by_role("button", name="Find").click()
        page.wait_for_url("**q=v2**")
        assert rows.count() == 10
    finally:
        context.close()
