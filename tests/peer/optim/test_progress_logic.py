"""Swarm progress and epoch rule without I/O (``peer.optim.shared.progress``)."""

from __future__ import annotations

import math

import pytest

from peer.optim.shared.progress import (
    PerformanceEMA,
    ProgressReport,
    ProgressWatch,
    compute_swarm_progress,
)


def report(
    peer: str, epoch: int, done: int, sps: float = 0.0, *, client: bool = False
) -> ProgressReport:
    return ProgressReport(peer, epoch, done, done, 100.0, sps, client)


def test_work_at_the_latest_epoch_is_summed_over_peers() -> None:
    others = [
        report("a", 2, 5, 10.0),
        report("b", 2, 7, 20.0, client=True),
        report("c", 1, 50, 30.0),
    ]
    progress = compute_swarm_progress(others, report("me", 2, 3, 5.0), 20)
    assert progress.epoch == 2
    assert progress.done_at_epoch == 15  # c's 50 at epoch 1 do not count
    assert progress.num_peers == 4 and progress.num_peers_at_epoch == 3
    assert progress.num_clients_at_epoch == 1
    assert progress.samples_per_second == 65.0
    assert not progress.ready
    assert progress.target_epoch == 2
    assert progress.epochs_behind == 0
    assert progress.seconds_left == pytest.approx(5 / 65.0)


def test_epoch_completes_when_the_swarm_reaches_the_target() -> None:
    others = [report("a", 0, 5), report("b", 0, 5), report("c", 0, 5)]
    assert not compute_swarm_progress(others, report("me", 0, 4), 20).ready
    done = compute_swarm_progress(others, report("me", 0, 5), 20)
    assert done.ready and done.target_epoch == 1 and done.seconds_left == 0.0
    assert math.isinf(compute_swarm_progress(others, report("me", 0, 4), 20).seconds_left)


def test_own_fresh_report_replaces_the_gossiped_one() -> None:
    stale = [report("me", 0, 1), report("a", 0, 3)]
    progress = compute_swarm_progress(stale, report("me", 0, 9), 20)
    assert progress.done_at_epoch == 12
    assert progress.num_peers == 2


def test_how_far_behind() -> None:
    others = [report("a", 5, 2)]
    progress = compute_swarm_progress(others, report("me", 2, 100), 20)
    assert progress.epoch == 5 and progress.epochs_behind == 3
    assert progress.done_at_epoch == 2
    ahead = compute_swarm_progress([report("a", 1, 2)], report("me", 3, 0), 20)
    assert ahead.epoch == 3 and ahead.epochs_behind == 0


def test_alone_the_swarm_is_this_peer() -> None:
    progress = compute_swarm_progress([], report("me", 0, 0), 1)
    assert progress.epoch == 0 and progress.num_peers == 1 and not progress.ready
    assert compute_swarm_progress([], report("me", 0, 1), 1).ready


def test_the_target_must_be_positive() -> None:
    with pytest.raises(ValueError):
        compute_swarm_progress([], report("me", 0, 0), 0)


def test_wire_round_trip_and_malformed_records() -> None:
    r = ProgressReport("p", 3, 4, 40, 123.5, 7.5, True)
    assert ProgressReport.from_wire("p", r.to_wire()) == r
    assert ProgressReport.from_wire("p", tuple(r.to_wire())) == r
    for bad in [
        None,
        "x",
        [1, 2, 3],
        [1, 2, 3, 1.0, 0.0],  # no client flag
        [-1, 0, 0, 1.0, 0.0, False],
        [True, 0, 0, 1.0, 0.0, False],
        [1, 2.5, 0, 1.0, 0.0, False],
        [1, True, 0, 1.0, 0.0, False],
        [1, 2, 3, float("nan"), 0.0, False],
        [1, 2, 3, 1.0, -1.0, False],
        [1, 2, 3, 1.0, float("inf"), False],
        [1, 2, 3, 1.0, 0.0, 1],
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


def test_a_discounted_claim_does_not_count_until_the_peer_reports_less() -> None:
    """A peer whose claims from epoch 5 on are discounted: at 10**9 it is left out; were it
    back at 4 it would count again. Without the discount the largest claim is the epoch."""
    others = [report("a", 2, 6), report("liar", 10**9, 10**6)]
    plain = compute_swarm_progress(others, report("me", 2, 6), 12)
    assert plain.epoch == 10**9 and plain.epochs_behind > 0
    ignored = compute_swarm_progress(others, report("me", 2, 6), 12, ignore={"liar": 3})
    assert ignored.epoch == 2 and ignored.done_at_epoch == 12 and ignored.ready
    assert ignored.num_peers == 2
    back = [report("a", 2, 6), report("liar", 2, 1)]
    assert compute_swarm_progress(back, report("me", 2, 6), 12, ignore={"liar": 3}).num_peers == 3


def test_a_watch_sees_the_others_move_and_not_itself_nor_a_newcomer() -> None:
    def at(peer: str, epoch: int, total: int) -> ProgressReport:
        return ProgressReport(peer, epoch, 0, total, 0.0)

    watch = ProgressWatch("me")
    assert not watch.moved([at("me", 0, 0), at("a", 3, 96)])  # a newcomer has not moved
    assert not watch.moved([at("me", 0, 50), at("a", 3, 96)])  # this peer itself moves
    assert watch.moved([at("me", 0, 50), at("a", 3, 112)])  # samples
    assert not watch.moved([at("a", 3, 112), at("b", 0, 0)])
    assert watch.moved([at("a", 4, 112), at("b", 0, 0)])  # an epoch
    assert not watch.moved([at("b", 0, 0)])  # "a" went away and is forgotten
    assert not watch.moved([at("a", 9, 999), at("b", 0, 0)])  # back: seen anew
