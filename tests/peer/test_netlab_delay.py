"""The delay line of swarmlab.netlab's links, without a device: packets out in order, on time."""

from __future__ import annotations

import pytest

from swarmlab.netlab_delay import DelayLine


def test_packets_come_out_after_the_delay_in_arrival_order() -> None:
    line = DelayLine(0.025, limit=1000)
    assert line.next_due() is None and line.due(5.0) == []
    assert line.push(b"a" * 100, now=1.0) and line.push(b"b" * 100, now=1.01)
    assert line.next_due() == pytest.approx(1.025)
    assert line.due(1.02) == [], "never early"
    assert line.due(1.025) == [b"a" * 100]
    assert line.held == 100
    assert line.due(2.0) == [b"b" * 100] and line.held == 0


def test_a_full_line_drops_what_arrives() -> None:
    line = DelayLine(0.0, limit=250)
    assert line.push(b"x" * 200, now=0.0)
    assert not line.push(b"y" * 100, now=0.0)
    assert line.dropped == 1 and line.held == 200
    assert line.due(0.0) == [b"x" * 200]
    assert line.push(b"y" * 100, now=0.0), "room again once sent"


def test_bad_settings_are_refused() -> None:
    with pytest.raises(ValueError, match="negative"):
        DelayLine(-0.001, limit=10)
    with pytest.raises(ValueError, match="limit"):
        DelayLine(0.01, limit=0)
