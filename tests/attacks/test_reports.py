"""Attacks through progress reports, against real coordinator processes on SQLite and
PostgreSQL: counters that would overflow the run's sums, a liar writing the run's samples/s,
and losses, metrics and groups no peer can produce."""

from __future__ import annotations

import re
import time
from typing import Any

import pytest

from server.config import Settings
from swarmlab.node_process import wait_until
from tests.attacks.conftest import Attack, Coordinator, CoordinatorFactory, Volunteer
from tests.conftest import scaled

pytestmark = pytest.mark.slow

HUGE = 2**53


def _pages(coordinator: Coordinator, run_id: str) -> dict[str, int]:
    """The status of every page and API a visitor or the organizer reads about the run."""
    paths = [
        "/",
        f"/runs/{run_id}",
        "/api/v1/runs",
        "/api/v1/dashboard",
        f"/api/v1/runs/{run_id}/dashboard",
        f"/api/v1/runs/{run_id}/progress",
    ]
    return {
        path: coordinator.http.get(path, headers=coordinator.organizer).status_code
        for path in paths
    }


def _progress(coordinator: Coordinator, run_id: str) -> dict[str, Any]:
    answer = coordinator.http.get(f"/api/v1/runs/{run_id}/progress")
    assert answer.status_code == 200, answer.text
    body: dict[str, Any] = answer.json()
    return body


def _refusals(coordinator: Coordinator, run_id: str) -> dict[str, tuple[int, str | None]]:
    """Per peer id: reports refused, and the bound the last one broke."""
    peers = coordinator.http.get(f"/api/v1/runs/{run_id}/peers", headers=coordinator.organizer)
    return {p["peer_id"]: (p["reports_refused"], p["last_refusal"]) for p in peers.json()["peers"]}


def _logged(coordinator: Coordinator, name: str, bound: str) -> bool:
    return bool(
        re.search(
            rf"refused a report of volunteer \d+ \('{name}'\).*bound {bound}", coordinator.log()
        )
    )


def test_rounds_that_would_overflow_the_sums(coordinator: Coordinator, attack: Attack) -> None:
    """1,028 reports of 2^53 averaging rounds from four peer tokens

    Before the bounds, SQLite's sum() of them overflowed and every page answered 503 for good
    (PostgreSQL's upsert failed instead)."""
    run_id = coordinator.create_run()
    honest = coordinator.join(run_id, coordinator.invite(run_id), display_name="honest")
    invite = coordinator.invite(run_id)
    liars = [coordinator.join(run_id, invite, display_name=f"liar{i}") for i in range(4)]
    assert coordinator.report(run_id, honest, samples=10, rounds_done=3).status_code == 202

    answers: list[int] = []
    for i in range(1028):
        liar = liars[i % 4]
        answer = coordinator.report(run_id, liar, epoch=i % 3, rounds_done=HUGE)
        answers.append(answer.status_code)
        if i == 0:
            assert "rounds" in answer.json()["detail"], answer.text
    assert set(answers) == {422}, sorted(set(answers))
    attack.outcome(
        f"{coordinator.backend}: all 1,028 reports refused with 422 (bound: rounds), counted "
        "per peer, logged naming the volunteer"
    )

    assert coordinator.report(run_id, honest, samples=20, rounds_done=2).status_code == 202
    assert wait_until(lambda: _progress(coordinator, run_id)["samples"] == 20, scaled(10))
    statuses = _pages(coordinator, run_id)
    assert set(statuses.values()) == {200}, statuses
    assert _progress(coordinator, run_id)["rounds_done"] == 5

    def counted() -> list[tuple[int, str | None]]:
        refused = _refusals(coordinator, run_id)
        return [refused[v.joined["peer_id"]] for v in (honest, *liars)]

    expected = [(0, None)] + [(257, "rounds")] * 4
    assert wait_until(lambda: counted() == expected, scaled(10)), counted()
    assert wait_until(lambda: _logged(coordinator, "liar0", "rounds"), scaled(10))
    attack.effect("every page and the progress API answer 200; the run counts the honest 5 rounds")


def _report_for(
    coordinator: Coordinator,
    run_id: str,
    volunteer: Volunteer,
    rate: float,
    started: float,
    **body: Any,
) -> None:
    samples = int(rate * (time.monotonic() - started))
    answer = coordinator.report(run_id, volunteer, samples=samples, **body)
    assert answer.status_code == 202, answer.text


# Claims are clamped to what a peer is credited for: at most the floor, before anybody is
# measured.
FLOOR = float(Settings.model_fields["report_rate_floor"].default)


def test_a_liar_claiming_a_huge_rate(start_coordinator: CoordinatorFactory, attack: Attack) -> None:
    """A liar claims 900,000 samples/s while its counter grows 99/s

    Before, the run's samples/s was the sum of the peers' claims."""
    coordinator = start_coordinator(SWARMGRAD_SNAPSHOT_INTERVAL_S="0.5")
    run_id = coordinator.create_run()
    invite = coordinator.invite(run_id)
    honest = coordinator.join(run_id, invite, display_name="honest")
    liar = coordinator.join(run_id, invite, display_name="liar")
    started = time.monotonic()
    seen: list[tuple[float, dict[str, Any]]] = []
    while time.monotonic() - started < 6.0:
        _report_for(coordinator, run_id, honest, 200.0, started, samples_per_second=210.0)
        _report_for(coordinator, run_id, liar, 99.0, started, samples_per_second=900_000.0)
        if time.monotonic() - started > 3.0:
            seen.append((time.monotonic(), _progress(coordinator, run_id)))
        time.sleep(0.2)  # the reports' pace: what the rate is measured over
    attack.outcome(
        f"{coordinator.backend}: its claim is shown only as the volunteers' compute rate, "
        f"clamped to what a peer is credited for ({FLOOR:,.0f} samples/s before any is measured)"
    )

    # The counters grew by about 299/s: that is what the run shows, not 900,000.
    (t0, first), (t1, last) = seen[0], seen[-1]
    growth = (last["samples"] - first["samples"]) / (t1 - t0)
    assert growth == pytest.approx(299, rel=0.5)
    # Within 50 %: the test's clock (which sets the counters) and the coordinator's (which
    # stamps the reports) disagree by a loaded machine's scheduling delays.
    for _, progress in seen:
        assert progress["samples_per_second"] == pytest.approx(growth, rel=0.5), progress
        # the floor at first, the others' measured rate times the multiple once measured
        assert 210 < progress["compute_samples_per_second"] <= 210 + FLOOR
    dashboard = coordinator.http.get(f"/api/v1/runs/{run_id}/dashboard").json()
    assert dashboard["headline"]["samples_per_second"] == pytest.approx(growth, rel=0.5)
    assert 210 < dashboard["headline"]["compute_samples_per_second"] <= 210 + FLOOR
    assert max(dashboard["series"]["samples_per_second"]) < 2 * growth
    overview = coordinator.http.get("/api/v1/dashboard").json()["runs"][0]
    assert overview["samples_per_second"] == pytest.approx(growth, rel=0.5)
    attack.effect(
        f"the run shows {last['samples_per_second']:.0f} samples/s, its counters' growth "
        f"({growth:.0f}/s), on the API, dashboard, chart and runs list"
    )


def test_losses_metrics_and_groups_no_peer_produces(
    coordinator: Coordinator, attack: Attack
) -> None:
    """Losses and metrics of ±1e300, groups of 10^6 and of more peers than joined

    Before, they were accepted and flattened every chart of the run."""
    run_id = coordinator.create_run()
    invite = coordinator.invite(run_id)
    honest = [coordinator.join(run_id, invite, display_name=f"honest{i}") for i in range(3)]
    liar = coordinator.join(run_id, invite, display_name="liar")
    for i, volunteer in enumerate(honest):
        body = {"samples": 10, "loss": 2.0 + i / 10, "eval_metric": 0.9, "group_size": 4}
        assert coordinator.report(run_id, volunteer, **body).status_code == 202
    wild: list[tuple[dict[str, Any], str]] = [
        ({"loss": 1e300}, "loss"),
        ({"loss": -1e300}, "loss"),
        ({"eval_metric": 1e300}, "eval_metric"),
        ({"eval_metric": -1e300}, "eval_metric"),
        ({"group_size": 10**6}, "group_size"),
        ({"group_size": 5}, "group_size"),  # four peers joined
    ]
    for body, bound in wild:
        answer = coordinator.report(run_id, liar, samples=10, **body)
        assert answer.status_code == 422 and bound in answer.text, (body, answer.text)
    refused = (6, "group_size")
    assert wait_until(
        lambda: _refusals(coordinator, run_id)[liar.joined["peer_id"]] == refused, scaled(10)
    ), _refusals(coordinator, run_id)
    assert wait_until(lambda: _logged(coordinator, "liar", "loss"), scaled(10))
    attack.outcome(
        f"{coordinator.backend}: all six refused with 422 (bounds: loss, eval_metric, "
        "group_size), logged naming the volunteer"
    )

    # One wild value within the bounds moves no headline nor chart: medians of the peers.
    body = {"samples": 20, "loss": 999_999.0, "eval_metric": -999_999.0, "group_size": 4}
    assert coordinator.report(run_id, liar, **body).status_code == 202
    assert wait_until(lambda: _progress(coordinator, run_id)["samples"] == 50, scaled(10))
    progress = _progress(coordinator, run_id)
    assert progress["loss"] == pytest.approx(2.15) and progress["eval_metric"] == 0.9
    assert progress["recent_group_sizes"] == [4, 4, 4, 4]
    for point in progress["history"]:
        assert point["loss"] is None or 2.0 <= point["loss"] <= 2.2, progress["history"]
    attack.effect("the run's loss is 2.15, its metric 0.9, its chart within 2.0-2.2")
