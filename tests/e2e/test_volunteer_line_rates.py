"""The rates on the volunteers' lines are those the run's dashboard counts: two ``swarmgrad
join`` processes train together, and each line's swarm figure is the run's samples/s the
coordinator counts, and the two volunteers' own figures add up to it (each counted over a
window of its own clock, a moment apart: equal within the spread of two such windows,
where the peers' claimed compute speeds are hundreds of times larger)."""

from __future__ import annotations

import re
import time
from pathlib import Path

import pytest

from peer.formats.rates import RATE_WINDOW_S
from swarmgrad.local import LocalCoordinator
from swarmlab.node_process import wait_until
from tests.conftest import scaled
from tests.e2e.test_volunteer_flow import (  # noqa: F401 (fixtures)
    EPOCH_LINE,
    Volunteer,
    coordinator,
    new_run,
    progress,
    volunteers,
)

pytestmark = pytest.mark.slow

RATES = re.compile(r"\| (\S+) samples/s \(swarm (\S+)\) \|")
# two windows of a few seconds over a training loop that alternates computing and averaging
SPREAD = 0.4


def line_rates(volunteer: Volunteer) -> tuple[float, float] | None:
    """(own, swarm) samples/s on the volunteer's newest epoch line, once it shows them."""
    for line in reversed(volunteer.lines):
        if found := RATES.search(line):
            if "-" in found.groups():
                return None
            own, swarm = (float(value.replace(",", "")) for value in found.groups())
            return own, swarm
    return None


def epoch_lines(volunteer: Volunteer) -> int:
    return sum(bool(EPOCH_LINE.search(line)) for line in volunteer.lines)


def test_the_line_shows_the_rates_the_dashboard_counts(
    coordinator: LocalCoordinator,  # noqa: F811
    tmp_path: Path,
    volunteers: list[Volunteer],  # noqa: F811
) -> None:
    run_id, token = new_run(coordinator)
    volunteers += [Volunteer(coordinator, token, tmp_path / f"v{i}") for i in range(2)]

    def together() -> bool:
        return progress(coordinator, run_id)["peers_online"] == 2 and all(
            v.samples > 0 for v in volunteers
        )

    assert wait_until(together, scaled(120)), [v.output() for v in volunteers]
    # both counts, the coordinator's and the volunteers', over a full window of training
    since = time.monotonic()
    assert wait_until(lambda: time.monotonic() - since > RATE_WINDOW_S + 2, scaled(60))

    for _ in range(3):  # at three new epoch lines
        printed = epoch_lines(volunteers[0])

        def new_line(printed: int = printed) -> bool:
            return epoch_lines(volunteers[0]) > printed

        assert wait_until(new_line, scaled(60))
        counted = progress(coordinator, run_id)["samples_per_second"]
        shown = [rates for v in volunteers if (rates := line_rates(v)) is not None]
        seen = f"dashboard {counted:.1f} samples/s; lines (own, swarm): {shown}"
        assert counted > 0 and len(shown) == len(volunteers), seen
        for _, swarm in shown:
            assert swarm == pytest.approx(counted, rel=SPREAD), seen
        assert sum(own for own, _ in shown) == pytest.approx(counted, rel=SPREAD), seen
