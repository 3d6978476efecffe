"""Attacks on a run's checkpoint through the public API of a real coordinator process."""

from __future__ import annotations

import pytest

from peer.formats.identity import Identity
from swarmlab.node_process import wait_until
from tests.attacks.conftest import Attack, Coordinator
from tests.attacks.test_identities import personal_credential
from tests.conftest import scaled

pytestmark = pytest.mark.slow


def archive(tag: int, size: int = 2000) -> bytes:
    """Bytes that start like a zip archive (what torch.save writes); the coordinator looks
    no further."""
    return b"PK\x03\x04" + bytes([tag % 256]) * (size - 4)


def test_checkpoint_far_past_the_swarm(attack: Attack, coordinator: Coordinator) -> None:
    """A checkpoint uploaded at epoch 2^53 replaces the run's checkpoint"""
    http = coordinator.http
    run_id = coordinator.create_run()
    invite = coordinator.invite(run_id)
    honest = sorted(
        (coordinator.join(run_id, invite) for _ in range(2)), key=lambda v: v.joined["peer_id"]
    )
    attacker = coordinator.join(run_id, invite)
    for volunteer in honest:
        assert coordinator.report(run_id, volunteer, epoch=3, samples=10).status_code == 202
    path = f"/api/v1/runs/{run_id}/checkpoint"
    octets = {"Content-Type": "application/octet-stream"}

    forged = http.put(
        path, params={"epoch": 2**53}, content=archive(66), headers={**attacker.headers, **octets}
    )
    assert forged.status_code == 422, forged.text
    attack.outcome(f"refused with {forged.status_code}")
    named = [
        line
        for line in coordinator.log().splitlines()
        if "refused a checkpoint" in line and attacker.joined["peer_id"] in line
    ]
    assert named and "volunteer" in named[0]
    attack.outcome("a log line names the volunteer")

    uploader = honest[0]  # the lowest peer id at the swarm's epoch
    stored = http.put(
        path, params={"epoch": 4}, content=archive(4), headers={**uploader.headers, **octets}
    )
    assert stored.status_code == 201, stored.text
    download = http.get(path, headers=coordinator.organizer)
    assert download.status_code == 200 and download.content == archive(4)
    assert download.headers["X-Checkpoint-Epoch"] == "4"
    newcomer = coordinator.join(run_id, invite)
    assert newcomer.joined["checkpoint"]["epoch"] == 4
    attack.effect("the honest upload of epoch 4 is taken, downloaded and given to newcomers")


def test_two_keys_of_one_volunteer_agree(attack: Attack, coordinator: Coordinator) -> None:
    """Two keys of one volunteer agree on a forged checkpoint"""
    http = coordinator.http
    run_id = coordinator.create_run()
    invite = coordinator.invite(run_id)
    honest = coordinator.join(run_id, invite)
    credential = personal_credential(coordinator, invite, "mallory")
    keys = []
    while len(keys) < 2:  # keys the run does not designate: peer ids above the honest one's
        identity = Identity()
        if identity.peer_id > honest.joined["peer_id"]:
            keys.append(coordinator.join(run_id, credential, identity))
    for volunteer in (honest, *keys):
        assert coordinator.report(run_id, volunteer, epoch=4, samples=10).status_code == 202

    def stored_at_epoch_4() -> bool:
        peers = http.get(f"/api/v1/runs/{run_id}/peers", headers=coordinator.organizer)
        return all(p["epoch"] == 4 for p in peers.json()["peers"])

    assert wait_until(stored_at_epoch_4, scaled(20))
    path = f"/api/v1/runs/{run_id}/checkpoint"
    octets = {"Content-Type": "application/octet-stream"}
    for key in keys:
        held = http.put(
            path, params={"epoch": 5}, content=archive(66), headers={**key.headers, **octets}
        )
        assert held.status_code == 202, held.text
    assert http.get(path, headers=coordinator.organizer).status_code == 404
    attack.outcome("both uploads held (202): one volunteer is one witness")
    taken = http.put(
        path, params={"epoch": 5}, content=archive(5), headers={**honest.headers, **octets}
    )
    assert taken.status_code == 201, taken.text
    assert http.get(path, headers=coordinator.organizer).content == archive(5)
    attack.effect("the designated honest upload of the epoch is taken and served")
