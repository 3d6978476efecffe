"""ComputeMeter: a step() call's time beyond its local work is waiting."""

from __future__ import annotations

import pytest

from peer.optim.utilisation import ComputeMeter


def test_calls_beyond_the_lower_decile_count_as_waiting() -> None:
    meter = ComputeMeter()
    assert meter.utilisation() is None
    for _ in range(9):
        meter.add(0.09, 0.01)  # forward/backward, then an inner step
    meter.add(0.09, 1.01)  # an inner step that also waited one second on a round
    assert meter.waiting == pytest.approx(1.0)
    assert meter.utilisation() == pytest.approx(1.0 / 2.0)  # 1 s computing of 2 s
    assert meter.take() == pytest.approx(0.5)
    assert meter.utilisation() is None, "take() starts over"
    for _ in range(4):
        meter.add(0.1, 0.02)
    assert meter.utilisation() == pytest.approx(1.0), "no call waited"


def test_bad_durations_are_refused() -> None:
    meter = ComputeMeter()
    with pytest.raises(ValueError, match="negative"):
        meter.add(-1.0, 0.0)
    with pytest.raises(ValueError, match="finite"):
        meter.add(float("nan"), 0.0)
    assert meter.calls == []


def test_a_measured_reference_tells_waiting_apart_when_every_call_waits() -> None:
    meter = ComputeMeter(reference=0.01)
    for _ in range(4):
        meter.add(0.1, 0.31)  # every call averages: 0.3 s of each is waiting
    assert meter.waiting == pytest.approx(1.2)
    assert meter.utilisation() == pytest.approx((0.4 + 0.04) / (0.4 + 1.24))
    unmeasured = ComputeMeter()
    for _ in range(4):
        unmeasured.add(0.1, 0.31)
    assert unmeasured.utilisation() == pytest.approx(1.0), "no call stands out"
    with pytest.raises(ValueError, match="reference"):
        ComputeMeter(reference=-1.0)


def test_a_call_s_own_timed_local_work_wins_over_the_reference() -> None:
    # a reference measured on a quiet core, calls slowed three-fold by the load of training:
    # what the optimizer timed of each call is its local work, only the rest is waiting
    meter = ComputeMeter(reference=0.01)
    meter.add(0.1, 0.03, 0.03)  # all of it the inner step, slowed: no waiting
    meter.add(0.1, 0.53, 0.03)  # and half a second blocked on a round
    meter.add(0.1, 0.02)  # not timed: the reference holds
    assert meter.waiting == pytest.approx(0.5 + 0.01)
    with pytest.raises(ValueError, match="negative"):
        meter.add(0.1, 0.1, -0.01)
    assert len(meter.calls) == len(meter.local) == 3
