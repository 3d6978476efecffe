"""Lookalike display names through a real coordinator process: a volunteer takes a name
that reads as another's on the public dashboard.

Guards :mod:`server.services.display_names`: ``clean`` (invisible characters refused) and
``comparison_key`` (NFKC, case folding, UTS #39 skeleton), as the join API and the invite
page use them. Without either, one of the names below is accepted as a second "honest".
"""

from __future__ import annotations

import re

import httpx
import pytest

from tests.attacks.conftest import Attack, Coordinator

pytestmark = pytest.mark.slow

CSRF = re.compile(r'name="csrf" value="([^"]+)"')

# Each reads "honest" on a page; the first is the honest volunteer's.
LOOKALIKES = {
    "HONEST": 409,  # case
    "h\u043enest": 409,  # CYRILLIC SMALL LETTER O
    "\uff48\uff4f\uff4e\uff45\uff53\uff54": 409,  # fullwidth letters (NFKC)
    "h\u03bfnest": 409,  # GREEK SMALL LETTER OMICRON
    "hon\u200best": 422,  # ZERO WIDTH SPACE
    "hon\u00adest": 422,  # SOFT HYPHEN
    "\u202ehonest": 422,  # RIGHT-TO-LEFT OVERRIDE
    "honest\u2800": 422,  # BRAILLE PATTERN BLANK
}


def redeem(coordinator: Coordinator, invite: str, name: str) -> httpx.Response:
    """Ask the invite page for a personal credential under ``name``, as a person does."""
    with httpx.Client(base_url=coordinator.url, timeout=30.0) as browser:
        page = browser.get(f"/join/{invite}")
        csrf = CSRF.search(page.text)
        assert csrf, page.text
        return browser.post(f"/join/{invite}", data={"csrf": csrf.group(1), "display_name": name})


def names_shown(coordinator: Coordinator, run_id: str) -> list[str]:
    """The names in the run's volunteers' table (read uncached)."""
    table = coordinator.http.get(f"/api/v1/runs/{run_id}/volunteers", params={"per_page": 100})
    return sorted(v["display_name"] for v in table.json()["volunteers"])


def test_lookalike_display_names(attack: Attack, coordinator: Coordinator) -> None:
    """Display names that read as another volunteer's"""
    run_id = coordinator.create_run()
    invite = coordinator.invite(run_id, max_uses=50)
    coordinator.join(run_id, invite, display_name="honest")
    for name, status in LOOKALIKES.items():
        refused = coordinator.join(run_id, invite, display_name=name, expect=status)
        detail = str(refused.joined["detail"])  # 422: the schema's validation error
        if status == 409:
            assert "already taken" in detail, detail
        else:
            assert "invisible" in detail and "U+" in detail, detail
    attack.outcome(
        f"{len(LOOKALIKES)} lookalikes of a taken name refused through the API "
        "(409 same name after NFKC, case and UTS #39 skeleton; 422 invisible characters)"
    )
    for name in LOOKALIKES:
        page = redeem(coordinator, invite, name)
        assert page.status_code == 422, (name, page.status_code)
        assert "already taken" in page.text or "invisible" in page.text, page.text
    attack.outcome("the same names refused on the invite page (422, with the reason)")

    assert names_shown(coordinator, run_id) == ["honest"]
    honest = ["José", "山田太郎", "Zoë O'Brien", "honest 2", "hönest"]
    for name in honest:
        coordinator.join(run_id, invite, display_name=name)
    assert redeem(coordinator, invite, "Ana María").status_code == 303
    assert names_shown(coordinator, run_id) == sorted(["honest", *honest, "Ana María"])
    attack.effect("one 'honest' on the dashboard; accented, CJK and distinct names accepted")
