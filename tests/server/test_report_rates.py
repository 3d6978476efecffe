"""Samples/s counted by the coordinator from the samples counters over its own clock: the
run's (from progress snapshots) and each machine's (from its reports) — pure rules."""

from __future__ import annotations

import pytest

from server.services.reports import counted_rate
from server.services.rollups import Bucket, machine_rates, single


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
