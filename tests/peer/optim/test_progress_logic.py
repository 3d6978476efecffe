"""Swarm progress and epoch rule without I/O (``peer.optim.progress``)."""

from __future__ import annotations

import pytest

from peer.optim.progress import (
    PerformanceEMA,
    ProgressReport,
    compute_swarm_progress,
)


def report(peer: str, epoch: int, steps: int, sps: float = 0.0) -> ProgressReport:
    return ProgressReport(peer, epoch, steps, total_steps=steps, time=100.0, samples_per_second=sps)


def test_steps_at_the_latest_epoch_are_summed_over_peers() -> None:
    others = [report("a", 2, 5, 10.0), report("b", 2, 7, 20.0), report("c", 1, 50, 30.0)]
    progress = compute_swarm_progress(others, report("me", 2, 3, 5.0), 20)
    assert progress.epoch == 2
    assert progress.steps_at_epoch == 15  # c's 50 steps at epoch 1 do not count
    assert progress.num_peers == 4 and progress.num_peers_at_epoch == 3
    assert progress.samples_per_second == 65.0
    assert not progress.should_advance
    assert progress.target_epoch == 2
    assert progress.epochs_behind == 0


def test_epoch_completes_when_the_swarm_reaches_the_total() -> None:
    others = [report("a", 0, 5), report("b", 0, 5), report("c", 0, 5)]
    assert not compute_swarm_progress(others, report("me", 0, 4), 20).should_advance
    done = compute_swarm_progress(others, report("me", 0, 5), 20)
    assert done.should_advance and done.target_epoch == 1


def test_own_fresh_report_replaces_the_gossiped_one() -> None:
    stale = [report("me", 0, 1), report("a", 0, 3)]
    progress = compute_swarm_progress(stale, report("me", 0, 9), 20)
    assert progress.steps_at_epoch == 12
    assert progress.num_peers == 2


def test_how_far_behind() -> None:
    others = [report("a", 5, 2)]
    progress = compute_swarm_progress(others, report("me", 2, 100), 20)
    assert progress.epoch == 5 and progress.epochs_behind == 3
    assert progress.steps_at_epoch == 2
    ahead = compute_swarm_progress([report("a", 1, 2)], report("me", 3, 0), 20)
    assert ahead.epoch == 3 and ahead.epochs_behind == 0


def test_alone_the_swarm_is_this_peer() -> None:
    progress = compute_swarm_progress([], report("me", 0, 0), 1)
    assert progress.epoch == 0 and progress.num_peers == 1 and not progress.should_advance
    assert compute_swarm_progress([], report("me", 0, 1), 1).should_advance


def test_total_steps_must_be_positive() -> None:
    with pytest.raises(ValueError):
        compute_swarm_progress([], report("me", 0, 0), 0)


def test_wire_round_trip_and_malformed_records() -> None:
    r = ProgressReport("p", 3, 4, 40, 123.5, 7.5)
    assert ProgressReport.from_wire("p", r.to_wire()) == r
    assert ProgressReport.from_wire("p", list(r.to_wire())) == r
    for bad in [
        None,
        "x",
        [1, 2, 3],
        [-1, 0, 0, 1.0, 0.0],
        [True, 0, 0, 1.0, 0.0],
        [1, 2.5, 0, 1.0, 0.0],
        [1, 2, 3, float("nan"), 0.0],
        [1, 2, 3, 1.0, -1.0],
        [1, 2, 3, 1.0, float("inf")],
    ]:
        assert ProgressReport.from_wire("p", bad) is None


def test_performance_ema_with_a_fake_clock() -> None:
    now = [0.0]
    ema = PerformanceEMA(alpha=0.5, clock=lambda: now[0])
    assert ema.update(10) == 0.0  # starts the clock
    now[0] = 1.0
    assert ema.update(10) == pytest.approx(10.0)
    now[0] = 1.5
    assert ema.update(10) == pytest.approx(15.0)  # mean of 10 and 20 while warming up
    ema.pause()
    now[0] = 100.0
    assert ema.update(10) == pytest.approx(15.0)  # the pause is not counted
    with pytest.raises(ValueError):
        PerformanceEMA(alpha=0.0)
