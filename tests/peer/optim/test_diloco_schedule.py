"""DiLoCo's schedule without a swarm: fragments, sync timing, stragglers, round timeouts,
and error feedback under a lossy codec."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from peer.compression import Blockwise4BitQuantization, Blockwise8BitQuantization
from peer.optim.diloco.error_feedback import ErrorFeedback
from peer.optim.diloco.sync_schedule import (
    RoundTimer,
    fragment_of,
    split_fragments,
    steps_before_sync,
    stragglers,
)
from peer.optim.shared.progress import ProgressReport


@given(
    sizes=st.lists(st.integers(1, 1000), min_size=1, max_size=30),
    fragments=st.integers(1, 30),
)
def test_fragments_cover_every_tensor_once_in_order(sizes: list[int], fragments: int) -> None:
    if fragments > len(sizes):
        with pytest.raises(ValueError, match="parameter tensors"):
            split_fragments(sizes, fragments)
        return
    out = split_fragments(sizes, fragments)
    assert len(out) == fragments and all(out)
    assert [i for f in out for i in f] == list(range(len(sizes)))


def test_fragments_are_about_equal_when_no_tensor_dominates() -> None:
    assert split_fragments([10] * 8, 4) == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert split_fragments([10, 10, 10, 10], 2) == [[0, 1], [2, 3]]
    assert split_fragments([100, 1, 1, 1], 2) == [[0], [1, 2, 3]]
    assert split_fragments([1, 1, 1, 100], 3) == [[0, 1], [2], [3]]


@given(h=st.integers(1, 200), fragments=st.integers(1, 200), rounds=st.integers(1, 5))
def test_each_fragment_syncs_every_inner_steps(h: int, fragments: int, rounds: int) -> None:
    if fragments > h:
        return
    steps = [steps_before_sync(k, h, fragments) for k in range(rounds * fragments)]
    assert all(s >= 1 for s in steps)
    # a full pass over the fragments takes exactly H inner steps, spread evenly
    for r in range(rounds):
        assert sum(steps[r * fragments : (r + 1) * fragments]) == h
    assert max(steps) - min(steps) <= 1
    assert [fragment_of(k, fragments) for k in range(fragments)] == list(range(fragments))


def test_plain_diloco_syncs_every_h_steps() -> None:
    assert [steps_before_sync(k, 50, 1) for k in range(3)] == [50, 50, 50]
    with pytest.raises(ValueError):
        steps_before_sync(-1, 50, 1)


def _report(peer: str, epoch: int, done: int, at: float) -> ProgressReport:
    return ProgressReport(peer, epoch, done, 0, at)


def test_stragglers_are_fresh_peers_at_the_sync_not_done_yet() -> None:
    reports = [
        _report("me", 3, 0, 100.0),
        _report("slow", 3, 2, 99.0),  # waited for
        _report("done", 3, 4, 99.0),  # done: in the round already
        _report("dead", 3, 1, 80.0),  # silent for 20 s: presumed gone
        _report("ahead", 4, 0, 99.0),
        _report("behind", 2, 1, 99.0),
    ]
    found = stragglers(reports, me="me", sync=3, target_steps=4, now=100.0, stale_after=5.0)
    assert found == ["slow"]


def test_round_timeouts_follow_measured_rounds_and_back_off_after_a_timeout() -> None:
    timer = RoundTimer(ceiling=60.0, floor=2.0, factor=3.0, window=3)
    assert timer.timeout() == 60.0  # nothing measured yet
    timer.succeeded(4.0)
    assert timer.timeout() == 12.0
    timer.succeeded(0.1)
    assert timer.timeout() == 12.0  # the slowest of the recent rounds
    for _ in range(3):
        timer.succeeded(0.1)  # the slow one left the window
    assert timer.timeout() == 2.0  # floor
    timer.timed_out()
    assert timer.timeout() == 2.0  # 0.3 * 2 is still under the floor
    for _ in range(6):
        timer.timed_out()
    assert timer.timeout() == pytest.approx(0.3 * 128)
    timer.timed_out()
    assert timer.timeout() == 60.0  # ceiling
    timer.succeeded(1.0)
    assert timer.timeout() == 3.0
    with pytest.raises(ValueError):
        RoundTimer(ceiling=1.0, floor=2.0)


@pytest.mark.parametrize("codec", [Blockwise4BitQuantization(), Blockwise8BitQuantization()])
def test_error_feedback_keeps_the_sum_of_what_was_sent_unbiased(codec) -> None:
    """The same pseudo-gradient sent a hundred times, one large entry per block setting the
    block's scale: without feedback the small entries are rounded the same way every time
    (to 0 with 4 bits) and the loss piles up; with it, the sum sent trails the true sum by
    one round's residual at most."""
    g = torch.Generator().manual_seed(0)
    delta = torch.randn(1024, generator=g) * 0.01
    small = torch.ones_like(delta, dtype=torch.bool)
    small[:: codec.block] = False
    delta[~small] = 1.0
    rounds = 100
    plain_sent = torch.zeros_like(delta)
    fed_sent = torch.zeros_like(delta)
    feedback = ErrorFeedback(codec)
    for _ in range(rounds):
        plain_sent += codec.extract(codec.compress(delta))
        values = [delta.clone()]
        feedback.apply(values)
        fed_sent += codec.extract(codec.compress(values[0]))
    truth = rounds * delta

    def error(sent: torch.Tensor) -> float:
        return float((sent - truth)[small].norm() / truth[small].norm())

    assert error(plain_sent) > 0.2
    assert error(fed_sent) < error(plain_sent) / 5
    assert feedback.residuals is not None
    assert (fed_sent - truth).abs().max() <= feedback.residuals[0].abs().max() + 1e-5


def test_error_feedback_refuses_tensors_of_other_shapes() -> None:
    feedback = ErrorFeedback(Blockwise8BitQuantization())
    feedback.apply([torch.ones(10)])
    with pytest.raises(ValueError, match="shapes"):
        feedback.apply([torch.ones(11)])
    feedback.reset()
    feedback.apply([torch.ones(11)])
