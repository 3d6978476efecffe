"""Hijacking the run's checkpoint by uploading an epoch the swarm has not reached, through
the public API of a real coordinator process with the run defaults.

Guarded by the epoch gate of :mod:`server.services.checkpoint_admission`: an upload more
than one epoch past what the other volunteers reached is held (its digest kept, 202),
never served, and blocks no upload of an earlier epoch. With the gate off
(``held_ahead`` always False) the attacker's upload is taken (201), the honest designated
upload of epoch 6 is refused (409) and the attacker's bytes are served: these tests fail.
"""

from __future__ import annotations

import pytest

from swarmlab.node_process import wait_until
from tests.attacks.conftest import Attack, Coordinator, Volunteer
from tests.attacks.test_checkpoints import archive
from tests.conftest import scaled

pytestmark = pytest.mark.slow

OCTETS = {"Content-Type": "application/octet-stream"}


def swarm_at(
    coordinator: Coordinator, run_id: str, volunteers: list[Volunteer], epoch: int
) -> None:
    """Report ``epoch`` for each volunteer and wait until the coordinator stored it."""
    for volunteer in volunteers:
        answer = coordinator.report(run_id, volunteer, epoch=epoch, samples=10 * epoch)
        assert answer.status_code == 202, answer.text
    ids = {v.joined["peer_id"] for v in volunteers}

    def stored() -> bool:
        peers = coordinator.http.get(
            f"/api/v1/runs/{run_id}/peers", headers=coordinator.organizer
        ).json()["peers"]
        return all(p["epoch"] == epoch for p in peers if p["peer_id"] in ids)

    assert wait_until(stored, scaled(20))


@pytest.mark.parametrize("ahead", [7, 105])
def test_checkpoint_hijack_past_the_swarm(
    attack: Attack, coordinator: Coordinator, ahead: int
) -> None:
    """A volunteer not designated for the next epoch uploads a later one, which nobody is designated for"""
    http = coordinator.http
    run_id = coordinator.create_run()
    invite = coordinator.invite(run_id)
    volunteers = sorted(
        (coordinator.join(run_id, invite) for _ in range(4)), key=lambda v: v.joined["peer_id"]
    )
    designated, attacker = volunteers[0], volunteers[1]
    swarm_at(coordinator, run_id, volunteers, 5)
    path = f"/api/v1/runs/{run_id}/checkpoint"

    forged = http.put(
        path, params={"epoch": ahead}, content=archive(66), headers={**attacker.headers, **OCTETS}
    )
    assert forged.status_code == 202, forged.text
    assert http.get(path, headers=coordinator.organizer).status_code == 404
    attack.outcome(f"epoch {ahead} at swarm epoch 5 held (202): digest kept, nothing served")
    held = [line for line in coordinator.log().splitlines() if "held a checkpoint" in line]
    assert held and attacker.joined["peer_id"] in held[0]
    attack.outcome("a log line names the volunteer")

    honest = http.put(
        path, params={"epoch": 6}, content=archive(6), headers={**designated.headers, **OCTETS}
    )
    assert honest.status_code == 201, honest.text
    download = http.get(path, headers=coordinator.organizer)
    assert download.status_code == 200 and download.content == archive(6)
    assert download.headers["X-Checkpoint-Epoch"] == "6"
    newcomer = coordinator.join(run_id, invite)
    assert newcomer.joined["checkpoint"]["epoch"] == 6
    attack.effect("the designated upload of epoch 6 is taken, served and handed to newcomers")


def test_a_swarm_whose_designated_uploader_left_gets_a_served_checkpoint(
    coordinator: Coordinator,
) -> None:
    """Honest: the next lowest peer id at the swarm's epoch uploads once the lowest left."""
    http = coordinator.http
    run_id = coordinator.create_run()
    invite = coordinator.invite(run_id)
    volunteers = sorted(
        (coordinator.join(run_id, invite) for _ in range(3)), key=lambda v: v.joined["peer_id"]
    )
    swarm_at(coordinator, run_id, volunteers, 5)
    gone, successor = volunteers[0], volunteers[1]
    left = http.post(f"/api/v1/runs/{run_id}/leave", headers=gone.headers)
    assert left.status_code == 204, left.text
    path = f"/api/v1/runs/{run_id}/checkpoint"
    taken = http.put(
        path, params={"epoch": 6}, content=archive(6), headers={**successor.headers, **OCTETS}
    )
    assert taken.status_code == 201, taken.text
    download = http.get(path, headers=coordinator.organizer)
    assert download.content == archive(6) and download.headers["X-Checkpoint-Epoch"] == "6"
