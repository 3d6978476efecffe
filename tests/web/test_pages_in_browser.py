"""The pages in a real browser against an in-process coordinator with seeded data: escaping
of hostile names, the Content-Security-Policy, accessibility (axe-core), and the layout at a
phone's and a laptop's width. Fast: no volunteer processes (those are in test_live_swarm.py)."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from tests.server.conftest import ADMIN_TOKEN
from tests.web.conftest import XSS, Site, axe_violations, settled


def pages(site: Site) -> dict[str, str]:
    return {
        "runs": f"{site.url}/",
        "dashboard": f"{site.url}/runs/{site.run_id}",
        "volunteer": f"{site.url}/runs/{site.run_id}/volunteers/{site.volunteer_id}",
        "invite": f"{site.url}/join/{site.invite}",
    }


def test_pages_carry_the_security_headers(site: Site) -> None:
    with httpx.Client() as client:
        for name, url in pages(site).items():
            answer = client.get(url)
            assert answer.status_code == 200, (name, answer.text)
            csp = answer.headers["content-security-policy"]
            assert "script-src 'self'" in csp and "frame-ancestors 'none'" in csp, name
            assert answer.headers["x-content-type-options"] == "nosniff"
            assert answer.headers["referrer-policy"] == "no-referrer"
            assert answer.headers["cache-control"] == "no-store"
            assert XSS not in answer.text, name  # only ever escaped


def test_a_hostile_name_is_text_everywhere_and_no_script_runs(site: Site, open_page: Any) -> None:
    for name, url in pages(site).items():
        page = open_page(url)
        settled(page)
        if name == "invite":
            page.get_by_label("Display name").fill(f"{XSS} too")  # XSS itself is taken
            page.get_by_role("button", name="Get my credential").click()
            assert page.locator("#volunteer-name").inner_text() == f"{XSS} too"
        else:
            assert XSS in page.locator("main").inner_text(), name
        assert page.locator("img[src=x]").count() == 0, name
    # A dialog (alert) would have been recorded by the page fixture and fail this test.


def test_dashboard_charts_are_drawn(site: Site, open_page: Any) -> None:
    page = open_page(pages(site)["dashboard"])
    for chart in ("loss", "throughput", "peers", "groups", "group-dist", "rounds"):
        canvas = page.locator(f"#chart-{chart} canvas")
        canvas.wait_for()
        painted = canvas.evaluate(
            """c => { const d = c.getContext('2d').getImageData(0, 0, c.width, c.height).data;
                      let n = 0; for (let i = 3; i < d.length; i += 4) if (d[i] > 0) n++; return n; }"""
        )
        assert painted > 500, (chart, painted)
    page.locator("#live-status[data-state=live]").wait_for()  # the feed connects too


@pytest.mark.parametrize("page_name", ["runs", "dashboard", "invite", "volunteer"])
def test_axe_finds_nothing_serious(site: Site, open_page: Any, page_name: str) -> None:
    page = open_page(pages(site)[page_name])
    settled(page)
    assert axe_violations(page) == []


def test_signed_in_dashboard_is_accessible_too(site: Site, open_page: Any) -> None:
    page = open_page(f"{site.url}/signin?next=/runs/{site.run_id}")
    page.get_by_label("Organizer token").fill(ADMIN_TOKEN)
    page.get_by_role("button", name="Sign in").click()
    page.wait_for_url(f"**/runs/{site.run_id}")
    page.get_by_role("button", name="Pause").wait_for()
    settled(page)
    assert axe_violations(page) == []


@pytest.mark.parametrize(("width", "height"), [(390, 844), (1280, 900)])
def test_dashboard_is_readable_on_a_phone_and_a_laptop(
    site: Site, open_page: Any, width: int, height: int
) -> None:
    page = open_page(pages(site)["dashboard"], width=width, height=height)
    settled(page)
    assert page.evaluate("document.documentElement.scrollWidth") <= width
    for metric in ("epoch", "samples", "samples_per_second", "peers_online"):
        assert page.locator(f"[data-metric={metric}]").is_visible(), metric
    box = page.locator("#chart-throughput canvas").bounding_box()
    assert box is not None and box["width"] <= width
