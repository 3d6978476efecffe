"""What a person sees, in a real browser at a laptop's (1280x900) and a phone's (390x844)
size, against an in-process coordinator with seeded data: every page fits the width signed
in and out, the credential page issues one credential however often it is reloaded, names
are unique, Finish asks first, the charts read right (and say something without
JavaScript), and the one formatting module writes what the server writes. Screenshots of every
page at both sizes go to ``test-artifacts/screenshots``."""

from __future__ import annotations

import re
import time
from typing import Any

import httpx
import pytest

from server.web import formatting
from swarmlab.node_process import wait_until
from tests.server.conftest import ADMIN_TOKEN, ORGANIZER, bearer
from tests.web.conftest import (
    ARTIFACTS,
    Site,
    axe_violations,
    expect_network_errors,
    join,
    settled,
)

SIZES = [pytest.param(1280, 900, id="laptop"), pytest.param(390, 844, id="phone")]


def sign_in(page: Any, url: str, next_path: str = "/") -> None:
    page.goto(f"{url}/signin?next={next_path}")
    page.get_by_label("Organizer token").fill(ADMIN_TOKEN)
    page.get_by_role("button", name="Sign in").click()
    page.wait_for_url(f"**{next_path}")


def fits(page: Any, width: int) -> None:
    settled(page)
    scroll = page.evaluate("document.documentElement.scrollWidth")
    assert scroll <= width, (page.url, scroll, width)


def new_invite(site: Site, **body: Any) -> str:
    answer = httpx.post(
        f"{site.url}/api/v1/runs/{site.run_id}/tokens", json=body, headers=ORGANIZER
    )
    assert answer.status_code == 201, answer.text
    return str(answer.json()["token"])


def invite_uses(site: Site, invite: str) -> int:
    token_id = invite.split("_")[1]
    tokens = httpx.get(f"{site.url}/api/v1/runs/{site.run_id}/tokens", headers=ORGANIZER).json()[
        "tokens"
    ]
    return int(next(t["uses"] for t in tokens if t["id"] == token_id))


@pytest.mark.parametrize(("width", "height"), SIZES)
def test_every_page_fits_the_screen_signed_out_and_in(
    site: Site, open_page: Any, width: int, height: int
) -> None:
    invite = new_invite(site, label="fits")
    signed_out = [
        "/",
        f"/runs/{site.run_id}",
        f"/runs/{site.run_id}/volunteers/{site.volunteer_id}",
        f"/join/{invite}",
        "/signin",
        "/runs/nosuchrun",
        "/no/such/page",
        "/join/sgj_0123456789abcdef_madeup",
    ]
    for path in signed_out:
        page = open_page(site.url + path, width=width, height=height)
        answer = page.swarmgrad_response
        # Unknown runs, paths and invites: an HTML page that says so, with the right status.
        missing = "such" in path or "madeup" in path
        assert answer.status == (404 if missing else 200), path
        assert answer.headers["content-type"].startswith("text/html"), path
        if missing:
            expect_network_errors(page)  # the browser logs the error page's 404
            assert page.get_by_role("heading", level=1).is_visible(), path
        fits(page, width)

    page = open_page(f"{site.url}/join/{invite}", width=width, height=height)
    page.get_by_label("Display name").fill(f"fits-{width}")
    page.get_by_role("button", name="Get my credential").click()
    page.locator("#credential").wait_for()
    fits(page, width)

    for path in ("/", f"/runs/{site.run_id}", f"/runs/{site.run_id}/finish"):
        page = open_page(site.url, width=width, height=height)
        sign_in(page, site.url, path)
        fits(page, width)
    # The organizer's dashboard: the invite form, a new link and the invites table.
    page = open_page(site.url, width=width, height=height)
    sign_in(page, site.url, f"/runs/{site.run_id}")
    page.get_by_label("Label").fill(f"a label long enough to need wrapping on a phone {width}")
    page.get_by_role("button", name="Create invite").click()
    page.locator("#invite-link").wait_for()
    fits(page, width)
    revoke = page.locator("#invites tr", has_text=f"wrapping on a phone {width}").get_by_role(
        "button", name="Revoke"
    )
    box = revoke.bounding_box()
    assert box is not None and box["x"] >= 0 and box["x"] + box["width"] <= width


@pytest.mark.parametrize(("width", "height"), SIZES)
def test_tables_reflow_on_a_phone(site: Site, open_page: Any, width: int, height: int) -> None:
    page = open_page(f"{site.url}/runs/{site.run_id}", width=width, height=height)
    settled(page)
    # Measured in one go inside the page: a live update may rebuild the table between two
    # separate look-ups, leaving a locator on a row that is gone.
    measured = page.evaluate(
        """() => {
            const row = document.querySelector('#volunteers tr[data-volunteer-id]');
            const cells = [...row.querySelectorAll('th, td')];
            const td = row.querySelector('td');
            return {
                boxes: cells.map(c => { const r = c.getBoundingClientRect();
                                        return {x: r.x, y: r.y, width: r.width}; }),
                label: getComputedStyle(td, '::before').content,
            };
        }"""
    )
    boxes = measured["boxes"]
    assert boxes and all(b["x"] + b["width"] <= width for b in boxes)
    if width < 700:  # one card per volunteer: cells stacked, each saying what it is
        assert len({round(b["y"]) for b in boxes}) == len(boxes)
        assert "Samples" in measured["label"]
    else:  # a table: one line per volunteer
        assert len({round(b["y"]) for b in boxes}) == 1


@pytest.mark.parametrize(("width", "height"), SIZES)
def test_reloading_the_credential_page_issues_nothing_new(
    site: Site, open_page: Any, width: int, height: int
) -> None:
    invite = new_invite(site, max_uses=5)
    page = open_page(f"{site.url}/join/{invite}", width=width, height=height)
    page.get_by_label("Display name").fill(f"reloader-{width}")
    page.get_by_role("button", name="Get my credential").click()
    credential = page.locator("#credential").inner_text().strip()
    assert page.url.endswith("/credential")
    page.reload()
    assert page.locator("#credential").inner_text().strip() == credential
    page.go_back()  # the invite page again: it sends this browser to its credential
    page.locator("#credential").wait_for()
    assert page.locator("#credential").inner_text().strip() == credential
    assert invite_uses(site, invite) == 1
    names = [
        v["display_name"]
        for v in httpx.get(f"{site.url}/api/v1/runs/{site.run_id}/dashboard").json()["volunteers"]
    ]
    assert names.count(f"reloader-{width}") == 1

    # The join command wraps between its arguments only.
    args = page.locator("#join-command .arg")
    assert [args.nth(i).inner_text() for i in range(args.count())][:2] == ["swarmgrad", "join"]
    for i in range(args.count() - 1):  # the credential may be longer than a phone's line
        lines = args.nth(i).evaluate("a => a.getClientRects().length")
        assert lines == 1, (i, args.nth(i).inner_text())
    box = page.locator("#join-command").bounding_box()
    assert box is not None and box["x"] + box["width"] <= width
    fits(page, width)


@pytest.mark.parametrize(("width", "height"), SIZES)
def test_a_taken_name_gets_a_clear_message(
    site: Site, open_page: Any, width: int, height: int
) -> None:
    invite = new_invite(site, max_uses=5)
    page = open_page(f"{site.url}/join/{invite}", width=width, height=height)
    page.get_by_label("Display name").fill("ADA")  # "ada" joined first
    page.get_by_role("button", name="Get my credential").click()
    expect_network_errors(page)  # the browser logs the answer's 422
    alert = page.locator("#name-error")
    assert (
        alert.inner_text() == "The display name “ADA” is already taken in this run; choose another."
    )
    assert page.get_by_label("Display name").get_attribute("aria-invalid") == "true"
    assert invite_uses(site, invite) == 0
    fits(page, width)


@pytest.mark.parametrize(("width", "height"), SIZES)
def test_finish_needs_a_confirmation_and_buttons_follow_the_state(
    site: Site, open_page: Any, width: int, height: int
) -> None:
    run = httpx.post(
        f"{site.url}/api/v1/runs",
        json={"name": f"to finish {width}", "task": "digits"},
        headers=ORGANIZER,
    ).json()
    page = open_page(site.url, width=width, height=height)
    sign_in(page, site.url, f"/runs/{run['id']}")
    pause, resume = (page.get_by_role("button", name=n) for n in ("Pause", "Resume"))
    finish = page.get_by_role("button", name="Finish…")
    assert pause.is_enabled() and resume.is_disabled() and finish.is_enabled()
    pause.click()
    page.locator("#run-status", has_text="paused").wait_for()
    assert pause.is_disabled() and resume.is_enabled() and finish.is_enabled()
    assert "paused" in page.locator("[data-metric=samples_per_second]").inner_text()

    finish.click()
    page.wait_for_url(f"**/runs/{run['id']}/finish")
    assert "This cannot be undone." in page.get_by_role("note").inner_text()
    fits(page, width)
    page.get_by_role("link", name="Cancel").click()
    page.wait_for_url(f"**/runs/{run['id']}")
    assert httpx.get(f"{site.url}/api/v1/runs/{run['id']}").json()["status"] == "paused"

    page.get_by_role("button", name="Finish…").click()
    page.get_by_role("button", name="Finish the run for good").click()
    page.wait_for_url(f"**/runs/{run['id']}")
    page.locator("#run-status", has_text="finished").wait_for()
    assert httpx.get(f"{site.url}/api/v1/runs/{run['id']}").json()["status"] == "finished"
    for name in ("Pause", "Resume", "Finish…"):
        assert page.get_by_role("button", name=name).is_disabled(), name


def axis(page: Any, chart: str, index: int) -> dict[str, Any]:
    """What uPlot drew on one axis: its split values, their labels and pixel positions, and
    the width of the widest label."""
    return page.locator(f"#chart-{chart}").evaluate(
        """(el, i) => {
            const u = el.swarmgradChart.plot, a = u.axes[i];
            const scale = a.scale || (i === 0 ? 'x' : 'y');
            const ctx = document.createElement('canvas').getContext('2d');
            ctx.font = a.font ? a.font[0] : '12px system-ui';
            const labels = (a._values || []).map(String);
            return {
                splits: a._splits || [],
                labels,
                positions: (a._splits || []).map(v => u.valToPos(v, scale)),
                widest: Math.max(0, ...labels.map(l => ctx.measureText(l).width)),
                min: u.scales[scale].min,
                max: u.scales[scale].max,
            };
        }""",
        index,
    )


@pytest.mark.parametrize(("width", "height"), SIZES)
def test_charts_read_right(site: Site, open_page: Any, width: int, height: int) -> None:
    page = open_page(f"{site.url}/runs/{site.run_id}", width=width, height=height)
    for chart in ("loss", "throughput", "peers", "groups", "group-dist", "rounds"):
        page.locator(f"#chart-{chart} canvas").wait_for()
    settled(page)

    for chart in ("peers", "rounds"):  # counts: whole numbers from 0
        y = axis(page, chart, 1)
        assert y["labels"] and all(re.fullmatch(r"[\d,]+", label) for label in y["labels"]), y
        assert y["min"] == 0, y
    bins = axis(page, "group-dist", 0)
    assert bins["splits"] and all(float(v).is_integer() and v >= 0 for v in bins["splits"])
    assert 0 in bins["splits"] and bins["min"] < 0 < bins["max"], bins  # no bar cut in half
    assert axis(page, "group-dist", 1)["min"] == 0

    for chart in ("throughput", "peers", "rounds"):  # time labels do not overlap
        x = axis(page, chart, 0)
        assert all(re.fullmatch(r"\d\d:\d\d(:\d\d)?", label) for label in x["labels"]), x
        assert len(set(x["labels"])) == len(x["labels"]), x  # each label says a new time
        gaps = [b - a for a, b in zip(x["positions"], x["positions"][1:], strict=False)]
        assert all(gap > x["widest"] + 4 for gap in gaps), (chart, gaps, x["widest"])

    legend = page.locator("#chart-loss .u-legend .u-label")
    assert [legend.nth(i).inner_text() for i in range(legend.count())] == [
        "samples",
        "loss",
        "eval metric",
    ]
    legend = page.locator("#chart-peers .u-legend .u-label")
    assert [legend.nth(i).inner_text() for i in range(legend.count())] == [
        "time (UTC)",
        "peers online",
    ]

    over = page.locator("#chart-peers .u-over")
    over.scroll_into_view_if_needed()
    box = over.bounding_box()
    assert box is not None
    page.mouse.move(box["x"] + box["width"] * 0.98, box["y"] + box["height"] / 2)
    values = page.locator("#chart-peers .u-legend .u-value")
    when, peers = values.nth(0).inner_text(), values.nth(1).inner_text()
    assert re.fullmatch(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d UTC", when), when
    assert re.fullmatch(r"\d+", peers), peers


@pytest.mark.parametrize(("width", "height"), SIZES)
def test_without_javascript_charts_show_their_recent_points(
    site: Site, browser: Any, width: int, height: int
) -> None:
    context = browser.new_context(
        viewport={"width": width, "height": height}, java_script_enabled=False
    )
    try:
        page = context.new_page()
        page.goto(f"{site.url}/runs/{site.run_id}")
        tables = page.locator("figure table.points")
        assert tables.count() == 6
        caption = tables.first.locator("caption").inner_text()
        assert "charts need JavaScript" in caption
        assert tables.nth(2).locator("tbody tr").count() >= 1  # peers online, recent points
        assert page.evaluate("document.documentElement.scrollWidth") <= width
        shots = ARTIFACTS / "screenshots"
        shots.mkdir(parents=True, exist_ok=True)
        page.screenshot(path=str(shots / f"dashboard-no-javascript-{width}.png"), full_page=True)
    finally:
        context.close()


CASES: list[tuple[str, object]] = [
    ("integer", 0),
    ("integer", 12544),
    ("integer", 1234567.4),
    ("integer", None),
    ("rate", 47108.4),
    ("rate", 99.94),
    ("rate", 12.34),
    ("rate", 0.4567),
    ("rate", 0),
    ("measure", 2.302585),
    ("measure", 0.034127),
    ("measure", 12.3456),
    ("measure", 1234.6),
    ("measure", 0),
    ("measure", None),
    ("percent", 0.125),
    ("percent", 0.0004),
    ("percent", 1),
    ("duration", 0),
    ("duration", 45.2),
    ("duration", 59.6),
    ("duration", 754),
    ("duration", 3 * 3600 + 5 * 60 + 9),
    ("duration", 2 * 86400 + 4 * 3600),
    ("ago", 3),
    ("ago", 42.9),
    ("ago", 185),
    ("ago", 7300),
    ("ago", 200000),
    ("ago", None),
    ("eta", None),
    ("eta", 0),
    ("eta", 100.2),
    ("eta", 7300),
]


def test_the_browser_and_the_server_format_alike(site: Site, open_page: Any) -> None:
    page = open_page(f"{site.url}/")
    written = page.evaluate(
        """async cases => {
            const f = await import('/static/js/format.js');
            return cases.map(([name, value]) => f[name](value));
        }""",
        [list(case) for case in CASES],
    )
    expected = [formatting.FILTERS[name](value) for name, value in CASES]
    assert written == expected
    assert expected[:5] == ["0", "12,544", "1,234,567", "–", "47,108"]
    assert formatting.FILTERS["ago"](185) == "3 min ago"
    when = page.evaluate(
        "async () => (await import('/static/js/format.js')).datetime('2026-11-26T22:53:07.5Z')"
    )
    assert when == "2026-11-26 22:53:07 UTC"


@pytest.mark.parametrize(("width", "height"), SIZES[1:])
def test_a_volunteer_gone_silent_shows_offline_within_25_s(
    site: Site, open_page: Any, width: int, height: int
) -> None:
    """No retraction, no goodbye: the volunteer's reports just stop (its process is gone).
    Presence is decided by the coordinator and drawn by the same code at every size: one size
    is enough here (25 s of waiting); a volunteer that leaves is shown at both below."""
    name = f"leaver-{width}"
    with httpx.Client(base_url=site.url) as client:
        peer = join(client, site.run_id, site.invite, name)
        report = {"epoch": 5, "samples": 10, "samples_per_second": 5.0, "group_size": 2}
        answer = client.post(
            f"/api/v1/runs/{site.run_id}/reports", json=report, headers=bearer(peer["peer_token"])
        )
        assert answer.status_code == 202
        last_contact = time.monotonic()
    page = open_page(f"{site.url}/runs/{site.run_id}", width=width, height=height)
    row = page.locator("#volunteers tr[data-volunteer-id]", has_text=name)
    row.locator(".badge-running").wait_for(timeout=5000)
    assert int(page.locator("[data-metric=peers_online]").inner_text()) >= 1
    row.locator(".badge-running").wait_for(state="detached", timeout=35000)
    gone_after = time.monotonic() - last_contact
    # PRESENCE_S (25 s) of silence, and the next live update; and not before: one report
    # interval (10 s) late is no reason to show it offline.
    assert 20 <= gone_after <= 26.5, gone_after
    assert page.locator("[data-metric=peers_online]").inner_text() == "0"
    assert "s ago" in row.locator("time").inner_text()
    # The peers chart ends at now's count, not at the last snapshot's.
    last = page.locator("#chart-peers").evaluate("el => el.swarmgradChart.plot.data[1].at(-1)")
    assert last == 0


@pytest.mark.parametrize(("width", "height"), SIZES)
def test_a_volunteer_that_leaves_shows_offline_within_10_s(
    site: Site, open_page: Any, width: int, height: int
) -> None:
    """A clean stop (Ctrl-C of ``swarmgrad join``, the end of a run): the volunteer says it
    leaves, and the page shows it offline at its next live update, not after 25 s."""
    name = f"goodbye-{width}"
    with httpx.Client(base_url=site.url) as client:
        peer = join(client, site.run_id, site.invite, name)
        headers = bearer(peer["peer_token"])
        report = {"epoch": 5, "samples": 10, "samples_per_second": 5.0, "group_size": 2}
        answer = client.post(f"/api/v1/runs/{site.run_id}/reports", json=report, headers=headers)
        assert answer.status_code == 202
        page = open_page(f"{site.url}/runs/{site.run_id}", width=width, height=height)
        row = page.locator("#volunteers tr[data-volunteer-id]", has_text=name)
        row.locator(".badge-running").wait_for(timeout=5000)
        online = int(page.locator("[data-metric=peers_online]").inner_text())
        assert online >= 1
        # The volunteer's own page says the same, and follows it too (it rereads itself).
        own = open_page(
            f"{site.url}/runs/{site.run_id}/volunteers/{name}", width=width, height=height
        )
        machine = own.locator("#machines tbody tr").first
        assert machine.locator(".badge-running").is_visible()
        answer = client.post(f"/api/v1/runs/{site.run_id}/leave", headers=headers)
        assert answer.status_code == 204, answer.text
        left = time.monotonic()
    row.locator(".badge-running").wait_for(state="detached", timeout=15000)
    gone_after = time.monotonic() - left
    assert gone_after <= 10, gone_after
    # The headline's count comes with the live document, the table's page may come first.
    assert wait_until(
        lambda: int(page.locator("[data-metric=peers_online]").inner_text()) <= online - 1,
        max(0.5, 10 - gone_after),
    ), page.locator("[data-metric=peers_online]").inner_text()
    assert row.count() == 1  # still listed, as offline
    own.locator("#machines tbody tr .badge-running").wait_for(state="detached", timeout=15000)
    assert time.monotonic() - left <= 12  # its next reading, every 10 s
    assert own.locator("#machines tbody tr td[data-label='Samples/s']").inner_text() == "0"
    fits(own, width)


def test_the_new_pages_are_accessible(site: Site, open_page: Any) -> None:
    invite = new_invite(site)
    page = open_page(f"{site.url}/join/{invite}")
    page.get_by_label("Display name").fill("axe")
    page.get_by_role("button", name="Get my credential").click()
    page.locator("#credential").wait_for()
    assert axe_violations(page) == [], "credential"
    run = httpx.post(
        f"{site.url}/api/v1/runs", json={"name": "axe", "task": "digits"}, headers=ORGANIZER
    ).json()
    page = open_page(site.url)
    sign_in(page, site.url, f"/runs/{run['id']}/finish")
    assert axe_violations(page) == [], "finish"
    page = open_page(f"{site.url}/no/such/page")
    expect_network_errors(page)
    assert axe_violations(page) == [], "not found"
