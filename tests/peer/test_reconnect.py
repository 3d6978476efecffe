"""Departed peers are dialed again: the bookkeeping, without sockets."""

from __future__ import annotations

import random

import pytest

from peer.node.reconnect import Reconnector


def _reconnector(**kwargs) -> Reconnector:
    options = {"interval": 10.0, "give_up_after": 100.0, "rng": random.Random(0)}
    return Reconnector(**(options | kwargs))


def test_one_departed_peer_per_interval() -> None:
    r = _reconnector()
    r.departed("a", ("mem://a:1",), now=0.0)
    r.departed("b", ("mem://b:1",), now=1.0)
    assert r.due(5.0) is None, "the first try waits one interval after the first departure"
    first = r.due(10.0)
    assert first in {("a", "mem://a:1"), ("b", "mem://b:1")}
    assert r.due(15.0) is None
    assert r.due(20.0) is not None


def test_a_clean_leave_or_client_mode_is_not_dialed() -> None:
    r = _reconnector()
    r.departed("quiet", (), now=0.0)
    assert len(r) == 0 and r.due(50.0) is None


def test_returned_live_and_long_gone_peers_are_dropped() -> None:
    r = _reconnector()
    r.departed("a", ("mem://a:1",), now=0.0)
    r.departed("b", ("mem://b:1",), now=0.0)
    r.departed("c", ("mem://c:1",), now=95.0)
    r.returned("a")
    assert "a" not in r
    assert r.due(10.0, live={"b"}) == ("c", "mem://c:1")
    assert "b" not in r
    assert r.due(196.0) is None and len(r) == 0, "given up after give_up_after"


def test_capacity_keeps_the_most_recent_departures() -> None:
    r = _reconnector(capacity=2)
    for i, name in enumerate("abc"):
        r.departed(name, (f"mem://{name}:1",), now=float(i))
    assert "a" not in r and "b" in r and "c" in r


def test_bad_settings_are_refused() -> None:
    with pytest.raises(ValueError):
        Reconnector(interval=0, give_up_after=1)
    with pytest.raises(ValueError):
        Reconnector(interval=1, give_up_after=1, capacity=0)
