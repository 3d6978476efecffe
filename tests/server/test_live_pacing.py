"""A live feed spends at most ``MAX_BUILD_SHARE`` of its worker's time building documents.

The dashboard of a run with 10,000 volunteers (``bench/coordinator_load.py --volunteers
10000``) took 150-250 ms to build on the 2-core development VM; rebuilt every
``LIVE_INTERVAL_S`` (0.5 s) that was a third to half of a worker, taken from the reports
that worker answers. Here the clock and the pauses are the test's: no timing is measured.
"""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import pytest

from server import live
from server.live import MAX_BUILD_SHARE, pause_s


def test_a_quick_build_waits_the_interval() -> None:
    assert pause_s(0.5, 0.002) == 0.5
    assert pause_s(0.5, 0.0) == 0.5


@pytest.mark.parametrize("build_s", [0.2, 1.0, 30.0])
def test_a_slow_build_is_paced_to_its_share(build_s: float) -> None:
    pause = pause_s(0.5, build_s)
    assert pause > 0.5
    assert build_s / (build_s + pause) == pytest.approx(MAX_BUILD_SHARE)


async def test_the_feed_waits_as_its_builds_cost(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = SimpleNamespace(now=0.0)
    costs = [0.01, 1.0, 0.01]
    pauses: list[float] = []

    async def sleep(seconds: float) -> None:
        pauses.append(seconds)

    monkeypatch.setattr(live, "time", SimpleNamespace(perf_counter=lambda: clock.now))
    monkeypatch.setattr(live, "asyncio", SimpleNamespace(to_thread=asyncio.to_thread, sleep=sleep))
    feed: live._Feed
    queue: asyncio.Queue[dict[str, Any] | None] = asyncio.Queue(maxsize=1)

    def build() -> dict[str, Any]:
        n = len(pauses)
        clock.now += costs[n]
        if n == len(costs) - 1:
            feed.subscribers.clear()  # the last browser leaves: the feed stops
        return {"version": str(n)}

    feed = live._Feed(build, interval_s=0.5)
    feed.subscribers.add(queue)
    await feed.run()
    assert pauses == [0.5, pytest.approx(3.0), 0.5]
