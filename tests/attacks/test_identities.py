"""Attacks that multiply one volunteer through a real coordinator process."""

from __future__ import annotations

import re

import httpx
import pytest

from peer.formats.identity import Certificate
from tests.attacks.conftest import Attack, Coordinator

pytestmark = pytest.mark.slow

CSRF = re.compile(r'name="csrf" value="([^"]+)"')
TOKEN = re.compile(r"sgj_[A-Za-z0-9_-]+")


def personal_credential(coordinator: Coordinator, invite: str, name: str) -> str:
    """Redeem ``invite`` on its page, as a person does, for a personal credential."""
    with httpx.Client(base_url=coordinator.url, timeout=30.0, follow_redirects=True) as browser:
        page = browser.get(f"/join/{invite}")
        csrf = CSRF.search(page.text)
        assert csrf, page.text
        shown = browser.post(f"/join/{invite}", data={"csrf": csrf.group(1), "display_name": name})
        assert shown.status_code == 200, shown.text
        tokens = set(TOKEN.findall(shown.text)) - {invite}
        assert len(tokens) == 1, shown.text
        return tokens.pop()


def test_one_credential_many_machines(attack: Attack, coordinator: Coordinator) -> None:
    """A personal credential joins any number of machines"""
    run_id = coordinator.create_run(max_machines=3)
    invite = coordinator.invite(run_id)
    credential = personal_credential(coordinator, invite, "mallory")
    keys = [coordinator.join(run_id, credential) for _ in range(3)]
    refused = [coordinator.join(run_id, credential, expect=403) for _ in range(3)]
    assert all("max_machines" in r.joined["detail"] for r in refused)
    attack.outcome(f"key 4 and later refused with 403 ({len(keys)} machines allowed)")
    owners = {Certificate.from_base64(k.joined["certificate"]).volunteer for k in keys}
    assert len(owners) == 1 and None not in owners
    volunteer = owners.pop()
    assert any(
        "refused a new key" in line and f"volunteer {volunteer}" in line
        for line in coordinator.log().splitlines()
    )
    attack.outcome("certificates name one volunteer; a log line names it")
    honest = coordinator.join(run_id, invite)
    assert Certificate.from_base64(honest.joined["certificate"]).volunteer != volunteer
    again = coordinator.join(run_id, credential, keys[0].identity)
    assert again.joined["peer_id"] == keys[0].joined["peer_id"]
    attack.effect("honest volunteers join; a capped volunteer's own machines rejoin")
