"""Attacks on the bootstrap list through the public API of a real coordinator process."""

from __future__ import annotations

import socket

import pytest

from tests.attacks.conftest import Attack, Coordinator

pytestmark = pytest.mark.slow

CLAIMS = ["ws://169.254.169.254:80", "ws://10.0.0.1:22", "ws://127.0.0.1:6379"]


def test_claimed_addresses_are_not_served(attack: Attack, coordinator: Coordinator) -> None:
    """A join's claimed addresses poison every newcomer's bootstrap list"""
    http = coordinator.http
    run_id = coordinator.create_run()
    invite = coordinator.invite(run_id)
    attacker = coordinator.join(run_id, invite, addresses=CLAIMS, client_mode=False)

    with socket.socket() as listener:  # an honest peer that listens
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        honest = coordinator.join(
            run_id, invite, addresses=[f"ws://127.0.0.1:{port}"], client_mode=False
        )
        probe = http.post(
            f"/api/v1/runs/{run_id}/reachability", json={"port": port}, headers=honest.headers
        )
        assert probe.status_code == 200 and probe.json()["reachable"] is True, probe.text

    newcomer = coordinator.join(run_id, invite)
    served = {a for p in newcomer.joined["bootstrap"] for a in p["addresses"]}
    again = http.get(f"/api/v1/runs/{run_id}/bootstrap", headers=newcomer.headers)
    served |= {a for p in again.json()["peers"] for a in p["addresses"]}
    assert not served & set(CLAIMS), served
    assert attacker.joined["peer_id"] not in {p["peer_id"] for p in again.json()["peers"]}
    attack.outcome("no claimed address is served (only what the probe reached)")
    assert served == {f"ws://127.0.0.1:{port}"}
    attack.effect("newcomers get the honest peer's probed address")
