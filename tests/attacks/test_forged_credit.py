"""Forging credit with a samples counter just under the coordinator's static limit, through
the public API of a real coordinator process with the run defaults.

Guarded by the credit bound of :mod:`server.services.credit_rates`: a peer is credited at
most ``report_rate_multiple`` times the median rate the coordinator measures for the other
volunteers (from its own clock), its claimed samples/s clamped to the same. With the bound
off (``CreditLimits.limit`` returning the static per-peer limit) the forger is credited its
58.5 M samples and the run's claimed rate reads about 1 M samples/s: these tests fail.
"""

from __future__ import annotations

import time
from typing import Any

import pytest

from server.services.credit_rates import CREDIT_GRACE_S, MEASURE_MIN_S
from swarmlab.node_process import wait_until
from tests.attacks.conftest import Attack, Coordinator, Volunteer
from tests.conftest import scaled

pytestmark = pytest.mark.slow

# The run defaults (server.config): the multiple of the others' median a peer is credited for.
MULTIPLE = 4.0
# What the honest volunteer really does, samples per second.
HONEST_RATE = 150


def peers_of(coordinator: Coordinator, run_id: str) -> dict[str, dict[str, Any]]:
    answer = coordinator.http.get(f"/api/v1/runs/{run_id}/peers", headers=coordinator.organizer)
    assert answer.status_code == 200, answer.text
    return {p["peer_id"]: p for p in answer.json()["peers"]}


def wait_for_clock(seconds: float) -> None:
    """Let the coordinator's clock (the wall clock) run ``seconds``."""
    until = time.time() + seconds
    assert wait_until(lambda: time.time() >= until, seconds + scaled(5))


def report_real_work(
    coordinator: Coordinator, run_id: str, volunteer: Volunteer, joined_at: float
) -> int:
    """Report the samples ``volunteer`` did since it joined at HONEST_RATE; waits until
    stored. The counter reported."""
    samples = int(HONEST_RATE * (time.time() - joined_at))
    answer = coordinator.report(
        run_id, volunteer, epoch=1, samples=samples, samples_per_second=HONEST_RATE
    )
    assert answer.status_code == 202, answer.text
    peer_id = volunteer.joined["peer_id"]
    assert wait_until(lambda: peers_of(coordinator, run_id)[peer_id]["samples"] == samples, 20)
    return samples


def test_forged_credit_just_under_the_static_limit(
    attack: Attack, coordinator: Coordinator
) -> None:
    """A volunteer reports a samples counter just under the coordinator's static per-peer limit"""
    run_id = coordinator.create_run()
    invite = coordinator.invite(run_id)
    honest = coordinator.join(run_id, invite)
    honest_joined = time.time()
    # The honest volunteer is measured once its reports span MEASURE_MIN_S; the run's rates
    # are read again at most every report_swarm_refresh_s (5 s) after that report.
    wait_for_clock(MEASURE_MIN_S + 1)
    report_real_work(coordinator, run_id, honest, honest_joined)
    wait_for_clock(5.5)
    forger = coordinator.join(run_id, invite)
    forger_joined = time.time()
    wait_for_clock(4)
    forged = coordinator.report(
        run_id, forger, epoch=1, samples=58_500_000, samples_per_second=999_999.0
    )
    assert forged.status_code == 202, forged.text  # accepted, and credited up to the bound
    mine = report_real_work(coordinator, run_id, honest, honest_joined)

    def credited() -> int:
        return int(peers_of(coordinator, run_id)[forger.joined["peer_id"]]["samples"])

    assert wait_until(lambda: credited() > 0, 20)
    honest_measured = mine / (time.time() - honest_joined)
    bound = MULTIPLE * HONEST_RATE * 1.2 * (time.time() - forger_joined + CREDIT_GRACE_S)
    forged_credit = credited()
    assert forged_credit <= bound, (forged_credit, bound, honest_measured)
    attack.outcome(
        f"58.5 M samples claimed, {forged_credit:,} credited "
        f"(at most {MULTIPLE:g}x the honest volunteer's measured rate)"
    )
    progress = coordinator.http.get(
        f"/api/v1/runs/{run_id}/progress", headers=coordinator.organizer
    ).json()
    assert progress["samples"] == mine + forged_credit
    claimed = progress["compute_samples_per_second"]
    assert claimed <= HONEST_RATE + MULTIPLE * HONEST_RATE * 1.2, claimed
    assert progress["samples_per_second"] <= (1 + MULTIPLE) * HONEST_RATE * 1.2 * 2
    attack.effect(
        f"the run shows {progress['samples_per_second']:,.0f} samples/s counted and "
        f"{claimed:,.0f} claimed, not ~1 M; the honest volunteer holds its {mine:,}"
    )


def test_a_volunteer_who_joins_in_the_first_minute_gets_its_real_credit(
    coordinator: Coordinator,
) -> None:
    """Honest: before anyone is measured the floor applies, generous for any machine."""
    run_id = coordinator.create_run()
    invite = coordinator.invite(run_id)
    first = coordinator.join(run_id, invite)
    wait_for_clock(1)
    second = coordinator.join(run_id, invite)
    # A fast machine: 20,000 samples/s for its first two seconds.
    wait_for_clock(2)
    for volunteer, samples in ((first, 60_000), (second, 40_000)):
        answer = coordinator.report(
            run_id, volunteer, epoch=1, samples=samples, samples_per_second=20_000.0
        )
        assert answer.status_code == 202, answer.text

    def credited() -> dict[str, int]:
        return {k: int(p["samples"]) for k, p in peers_of(coordinator, run_id).items()}

    expected = {first.joined["peer_id"]: 60_000, second.joined["peer_id"]: 40_000}
    assert wait_until(lambda: credited() == expected, 20), credited()
    progress = coordinator.http.get(
        f"/api/v1/runs/{run_id}/progress", headers=coordinator.organizer
    ).json()
    assert progress["samples"] == 100_000
    assert progress["compute_samples_per_second"] == 40_000.0
