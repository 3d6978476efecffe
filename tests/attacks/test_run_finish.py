"""Ending an honest run early by claiming its last epoch, through the public API of a real
coordinator process.

Guarded by how the coordinator decides a run reached its last epoch
(:func:`server.services.runs.swarm_epoch`): the volunteers online count per invite, as
their median reported epoch, and the run's figure is the second highest invite's, so one
volunteer's claim, with a checkpoint of that epoch to back it, finishes nothing. With the
rule off (the highest claim taken as the swarm's epoch) the attacker's report and upload
finish the run while the honest volunteers are an epoch short: this test fails.
"""

from __future__ import annotations

import pytest

from peer.formats.identity import Identity, peer_id_from_public_key
from swarmlab.node_process import wait_until
from tests.attacks.conftest import Attack, Coordinator, Volunteer
from tests.attacks.test_checkpoint_hijack import swarm_at
from tests.attacks.test_checkpoints import archive
from tests.conftest import scaled

pytestmark = pytest.mark.slow

OCTETS = {"Content-Type": "application/octet-stream"}
LAST = 3


def status(coordinator: Coordinator, run_id: str) -> dict[str, object]:
    answer = coordinator.http.get(f"/api/v1/runs/{run_id}")
    assert answer.status_code == 200, answer.text
    return dict(answer.json())


def test_a_volunteer_claiming_the_last_epoch_does_not_finish_the_run(
    attack: Attack, coordinator: Coordinator
) -> None:
    """A volunteer reports the run's last epoch and uploads its checkpoint while the swarm is an epoch short"""
    run_id = coordinator.create_run(epochs=LAST)
    # The attacker holds the lowest peer id: the run designates it as the uploader.
    keys = sorted(
        (Identity() for _ in range(3)), key=lambda i: peer_id_from_public_key(i.public_key)
    )
    attacker, *honest = [
        coordinator.join(run_id, coordinator.invite(run_id), identity) for identity in keys
    ]
    swarm_at(coordinator, run_id, [attacker, *honest], LAST - 1)

    claimed = coordinator.report(run_id, attacker, epoch=LAST, samples=10 * LAST)
    assert claimed.status_code == 202, claimed.text
    upload = coordinator.http.put(
        f"/api/v1/runs/{run_id}/checkpoint",
        params={"epoch": LAST},
        content=archive(LAST),
        headers={**attacker.headers, **OCTETS},
    )
    assert upload.status_code == 201, upload.text
    attack.outcome(f"its report of epoch {LAST} and checkpoint of epoch {LAST} are taken")
    # The claim is written, and a later batch after it (flushes run one at a time, each
    # followed by the check whether a run ended): the run must still be running.
    stored(coordinator, run_id, attacker, LAST, 10 * LAST)
    later = coordinator.report(run_id, honest[0], epoch=LAST - 1, samples=11 * LAST)
    assert later.status_code == 202, later.text
    stored(coordinator, run_id, honest[0], LAST - 1, 11 * LAST)
    assert status(coordinator, run_id)["status"] == "running"
    attack.outcome("the run stays running: one invite's claim is not the swarm's epoch")

    honest_reach(coordinator, run_id, honest)
    finished = status(coordinator, run_id)
    assert finished["finished_at_epoch"] == LAST
    assert finished["status_detail"] == f"reached its last epoch {LAST}"
    attack.effect(f"the run finishes by itself once the honest volunteers report epoch {LAST}")


def honest_reach(coordinator: Coordinator, run_id: str, honest: list[Volunteer]) -> None:
    for volunteer in honest:
        answer = coordinator.report(run_id, volunteer, epoch=LAST, samples=10 * LAST)
        assert answer.status_code == 202, answer.text
    assert wait_until(lambda: status(coordinator, run_id)["status"] == "finished", scaled(20))


def stored(
    coordinator: Coordinator, run_id: str, volunteer: Volunteer, epoch: int, samples: int
) -> None:
    """Wait until the coordinator wrote ``volunteer``'s report of ``epoch`` and ``samples``."""

    def written() -> bool:
        peers = coordinator.http.get(
            f"/api/v1/runs/{run_id}/peers", headers=coordinator.organizer
        ).json()["peers"]
        return any(
            (p["peer_id"], p["epoch"], p["samples"])
            == (volunteer.joined["peer_id"], epoch, samples)
            for p in peers
        )

    assert wait_until(written, scaled(20))
