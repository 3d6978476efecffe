"""Swarm progress and epoch rule without I/O (``peer.optim.progress``)."""

from __future__ import annotations

import math

import pytest

from peer.optim.progress import (
    PerformanceEMA,
    ProgressReport,
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


def test_one_peer_claiming_an_epoch_far_ahead_does_not_move_the_swarm() -> None:
    """With two honest peers at epoch 4, a third claiming 10**9 is not believed: nobody
    takes itself to be behind, and the honest work at epoch 4 completes the epoch."""
    others = [report("a", 4, 6), report("liar", 10**9, 10**6)]
    progress = compute_swarm_progress(others, report("me", 4, 6), 12)
    assert progress.epoch == 4 and progress.epochs_behind == 0
    assert progress.done_at_epoch == 12 and progress.ready


def test_an_epoch_two_peers_reached_is_the_swarms() -> None:
    """A peer that was away sees two others ahead (one a little further): it is behind, to
    the epoch both have reached; one peer ahead of the others alone waits for a second."""
    behind = compute_swarm_progress([report("a", 9, 1), report("b", 8, 3)], report("me", 2, 0), 20)
    assert behind.epoch == 8 and behind.epochs_behind == 6
    assert behind.done_at_epoch == 3  # a's work at 9 counts once another peer is there
    ahead = compute_swarm_progress([report("a", 3, 1), report("b", 3, 1)], report("me", 5, 9), 20)
    assert ahead.epoch == 3 and ahead.done_at_epoch == 2 and ahead.epochs_behind == 0


def test_in_a_swarm_of_two_the_other_peers_epoch_counts() -> None:
    """Two peers: no majority to tell a liar from a peer that trained on while this one was
    away, so this one catches up (as before)."""
    progress = compute_swarm_progress([report("a", 7, 2)], report("me", 3, 0), 20)
    assert progress.epoch == 7 and progress.epochs_behind == 4
