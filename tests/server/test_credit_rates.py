"""The credit bound's rules (server.services.credit_rates), without a database or a clock."""

from __future__ import annotations

import random
import statistics

import pytest
from fastapi import FastAPI
from sqlalchemy import select
from sqlalchemy.orm import sessionmaker

from server.clock import now_ms
from server.models import Peer
from server.schemas import ReportCreate
from server.services import report_guard
from server.services.credit_rates import (
    CREDIT_GRACE_S,
    MEASURE_MIN_S,
    MIN_RATE,
    CreditLimits,
    Measured,
    RunRates,
)
from server.services.report_bounds import PeerTrack, ReportLimits
from server.services.report_guard import ReportGuard
from tests.server.conftest import Api

LIMITS = CreditLimits(multiple=4.0, floor=50_000.0, ceiling=1e6)


def rates(*per_volunteer: float) -> RunRates:
    """Volunteers 1, 2, ... measured at these samples/s over 10 s."""
    return RunRates.of(
        0, [Measured(v, int(r * 10), 10_000) for v, r in enumerate(per_volunteer, start=1)]
    )


def test_a_volunteer_is_measured_once_it_counted_something_over_the_minimum_span() -> None:
    span = int(MEASURE_MIN_S * 1000)
    assert Measured(1, 500, span).rate == 500 / MEASURE_MIN_S
    assert Measured(1, 500, span - 1).rate is None
    assert Measured(1, 0, 60_000).rate is None
    assert rates().median_of_others(1) is None


@pytest.mark.parametrize("n", range(1, 8))
def test_the_median_of_the_others_is_their_lower_median(n: int) -> None:
    values = [float(10 * (i + 1)) for i in range(n)][::-1]
    run = rates(*values)
    for volunteer in range(1, n + 2):  # the last one is not measured at all
        others = sorted(v for i, v in enumerate(values, start=1) if i != volunteer)
        expected = statistics.median_low(others) if others else None
        assert run.median_of_others(volunteer) == expected


def test_one_liar_raises_nobodys_bound_but_its_own_is_the_others() -> None:
    run = rates(100, 120, 1_000_000)  # volunteer 3 claims a million a second
    assert LIMITS.limit(run, 3) == 4 * 100  # the others' lower median: 100
    assert LIMITS.limit(run, 1) == 4 * 120  # the liar is not the median of {120, 1e6}
    assert LIMITS.limit(run, 2) == 4 * 100


def naive_median_of_others(volunteers: list[Measured], volunteer_id: int) -> float | None:
    by_invite: dict[str, list[float]] = {}
    for m in volunteers:
        if m.volunteer_id != volunteer_id and (rate := m.rate) is not None:
            by_invite.setdefault(m.witness, []).append(rate)
    medians = [statistics.median_low(rates) for rates in by_invite.values()]
    return statistics.median_low(medians) if medians else None


@pytest.mark.parametrize("seed", range(40))
def test_the_others_rate_is_the_lower_median_of_the_other_invites_medians(seed: int) -> None:
    rng = random.Random(seed)
    invites = [f"invite-{i}" for i in range(rng.randint(1, 5))] + [""]
    volunteers = [
        Measured(
            v,
            rng.choice([0, rng.randint(1, 50) * 10]),  # some not measured; ties are common
            10_000,
            rng.choice(invites),
        )
        for v in range(1, rng.randint(1, 12) + 1)
    ]
    run = RunRates.of(0, volunteers)
    for volunteer in range(1, len(volunteers) + 2):
        assert run.median_of_others(volunteer) == naive_median_of_others(volunteers, volunteer)


def test_volunteers_minted_by_one_invite_count_once() -> None:
    """Forty volunteers of one shared invite claiming a million samples a second against three
    honest invites: the liars are one invite among four, and raise no bound."""
    honest = [
        Measured(v, rate * 10, 10_000, f"honest-{v}") for v, rate in enumerate([90, 100, 110])
    ]
    liars = [Measured(100 + i, 10**7, 10_000, "shared") for i in range(40)]
    run = RunRates.of(0, honest + liars)
    assert LIMITS.limit(run, 100) == 4 * 100  # a liar: the others' lower median, {90,100,110,1e6}
    assert LIMITS.limit(run, 0) == 4 * 110  # an honest one: {100, 110, 1e6}
    assert LIMITS.limit(run, 1) == 4 * 110  # {90, 110, 1e6}
    # counted per volunteer, the liars would have been the median of everyone
    per_volunteer = RunRates.of(
        0, [Measured(m.volunteer_id, m.samples, m.span_ms) for m in honest + liars]
    )
    assert LIMITS.limit(per_volunteer, 0) == 1e6


def test_the_floor_applies_until_another_volunteer_is_measured() -> None:
    assert LIMITS.limit(None, 1) == 50_000
    assert LIMITS.limit(rates(100), 1) == 50_000  # only its own rate is measured
    assert LIMITS.limit(rates(100), 2) == 400
    assert LIMITS.limit(rates(1), 2) == MIN_RATE  # never capped to nothing
    assert CreditLimits(4.0, 5e6, 1e6).limit(None, 1) == 1e6  # never above the static limit


def test_the_cap_grows_with_time_and_never_falls_below_what_was_credited() -> None:
    assert LIMITS.cap(400, 0, 5_000, 0) == int(400 * (5 + CREDIT_GRACE_S))
    assert LIMITS.cap(400, 0, 5_000, 10**9) == 10**9
    assert LIMITS.cap(400, 10_000, 5_000, 0) == int(400 * CREDIT_GRACE_S)  # clocks apart


async def test_a_failed_read_of_the_rates_is_tried_again_only_an_interval_later(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """While the database does not answer, a run's reports are judged by the floor, and
    cost one read of the rates per interval, not one each."""
    reads: list[int] = []

    def unavailable(*_: object) -> RunRates:
        reads.append(1)
        raise OSError("the database does not answer")

    clock = [1_000_000]
    monkeypatch.setattr(report_guard, "load_rates", unavailable)
    monkeypatch.setattr(report_guard, "now_ms", lambda: clock[0])
    guard = ReportGuard(
        sessionmaker(),
        ReportLimits(max_samples_per_second=1e6, max_epoch_lead=10),
        refresh_s=5.0,
        online_ttl_s=60.0,
        credit=LIMITS,
    )
    guard.remember(7, PeerTrack(clock[0] - 2_000, 1, 0, 0, None))
    body = ReportCreate(epoch=0, samples=10**6, samples_per_second=10**6)
    for _ in range(3):
        report = await guard.admit("run", 7, body)
        # The floor: 50,000 samples/s for the 2 s since it joined plus the grace.
        assert report.samples_cap == int(50_000 * (2 + CREDIT_GRACE_S))
        assert report.samples_per_second == 50_000
    assert len(reads) == 1
    clock[0] += 5_000
    await guard.admit("run", 7, ReportCreate(epoch=0, samples=10**6, samples_per_second=1.0))
    assert len(reads) == 2


async def test_the_rates_read_from_the_database_are_grouped_by_invite(
    app: FastAPI, api: Api
) -> None:
    run = await api.create_run()
    shared = (await api.create_join_token(run["id"]))["token"]
    own = (await api.create_join_token(run["id"]))["token"]
    minted = [await api.join(run["id"], shared) for _ in range(3)]
    alone = await api.join(run["id"], own)
    for peer, samples in [*((p, 10**6) for p in minted), (alone, 1_000)]:
        reply = await api.report(run["id"], peer, epoch=1, samples=samples)
        assert reply.status_code == 202, reply.text
    await app.state.report_buffer.flush()
    with app.state.session_factory() as session:
        # counted from ten seconds before the reports: every volunteer is measured
        for row in session.scalars(select(Peer).where(Peer.run_id == run["id"])):
            row.first_seen_ms = row.last_report_ms - 10_000
        session.commit()
        rates = report_guard.load_rates(session, run["id"], now_ms(), 60.0)
    assert sorted(len(v) for v in rates.by_invite.values()) == [1, 3]
    assert len(rates.medians) == 2
