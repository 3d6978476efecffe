"""Samples/s counted by the coordinator from the samples counters over its own clock: the
run's (from progress snapshots) and each machine's (from its reports) — pure rules."""

from __future__ import annotations

from typing import Any

import pytest

from server.services.rollups import Bucket, machine_rates, single
from server.services.run_totals import counted_rate


def test_the_runs_rate_is_its_counters_growth() -> None:
    assert counted_rate(5000, 20_000, (10_000, 1000)) == 400.0
    assert counted_rate(5000, 20_000, None) == 0.0  # no snapshot yet
    assert counted_rate(5000, 10_500, (10_000, 1000)) == 0.0  # under a second: not yet
    assert counted_rate(900, 20_000, (10_000, 1000)) == 0.0  # never negative


def test_a_machines_rate_is_its_counters_growth_whatever_it_claims() -> None:
    # Peer 1 reports every second, its counter growing 99/s; peer 2 restarts from zero
    # halfway (its old count is banked); peer 3 went silent long ago.
    reports = [single(1, 1000 * s, 99 * s) for s in range(30)]
    reports += [single(2, 1000 * s, 50 * s if s < 15 else 50 * (s - 15)) for s in range(30)]
    reports += [single(3, 1000 * s, 10 * s) for s in range(5)]
    rates = machine_rates(reports, now_ms=29_000, online_ttl_s=10, window_ms=10_000)
    assert rates[1] == pytest.approx(99.0)
    assert rates[2] == pytest.approx(50.0, rel=0.1)  # the reset costs one report's growth
    assert rates[3] == 0.0


def test_a_machines_rate_counts_rolled_up_buckets() -> None:
    bucket = Bucket(1, 0, 0, 9000, 10, 0, 900, 0)
    rates = machine_rates(
        [bucket, single(1, 20_000, 2000)], now_ms=20_000, online_ttl_s=60, window_ms=10_000
    )
    assert rates[1] == pytest.approx((2000 - 900) / 11)


async def test_the_runs_rate_runs_to_its_newest_report_not_to_now(app: Any, api: Any) -> None:
    """A volunteer reports every 10 s: between two reports the run's total stands still, and
    its rate must not sink with every second until the next one (a small run's headline
    would read up to half its rate); reports that stop still make it fall."""
    from sqlalchemy import update

    from server.clock import now_ms
    from server.models import Peer, ProgressSnapshot
    from server.services.run_totals import run_totals

    run = await api.create_run(name="rate")
    invite = (await api.create_join_token(run["id"]))["token"]
    await api.join(run["id"], invite)
    t = now_ms() - 60_000
    with app.state.session_factory() as session, session.begin():
        session.execute(
            update(Peer)
            .where(Peer.run_id == run["id"])
            .values(samples=1000, last_report_ms=t + 20_000, last_seen_ms=t + 20_000)
        )
        for taken, samples in ((t, 0), (t + 10_000, 500)):
            session.add(
                ProgressSnapshot(
                    run_id=run["id"],
                    taken_ms=taken,
                    epoch=0,
                    samples=samples,
                    samples_per_second=0.0,
                    peers_online=1,
                )
            )
    with app.state.session_factory() as session:
        # 9 s after the last report: 500 samples in the 10 s between the two reports.
        assert run_totals(session, run["id"], t + 29_000, 60).samples_per_second == 50.0
        # Silent for 25 s: counted up to 20 s before now, and falling.
        assert run_totals(session, run["id"], t + 45_000, 60).samples_per_second == 500 / 15
