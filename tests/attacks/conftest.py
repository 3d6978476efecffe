"""The standing attack suite: each test is one attack by a volunteer holding a valid invite.

A test takes the ``attack`` fixture and says, in words a reader of ``bench/redteam.py``'s
table understands, what the offender got (``attack.outcome(...)``: refused, excluded, capped)
and what the honest side saw (``attack.effect(...)``: unaffected, and by which measure). The
fixture's name is the test's docstring's first line. When ``SWARMGRAD_REDTEAM_LOG`` names a
file, one JSON line per attack is appended to it with the test's result, so the bench prints
the suite as a table without a second copy of any attack.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from dataclasses import dataclass, field

import pytest

LOG_VARIABLE = "SWARMGRAD_REDTEAM_LOG"


@dataclass
class Attack:
    name: str
    outcomes: list[str] = field(default_factory=list)
    effects: list[str] = field(default_factory=list)

    def outcome(self, text: str) -> None:
        """What happened to the offender (refused with 422, excluded from the group, ...)."""
        self.outcomes.append(text)

    def effect(self, text: str) -> None:
        """What the honest side saw (unaffected: pages answer 200, means exact, ...)."""
        self.effects.append(text)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]):  # type: ignore[no-untyped-def]
    report = yield
    if report.when == "call" or report.failed:
        item.stash.setdefault(_RESULTS, []).append(report)
    return report


_RESULTS = pytest.StashKey[list[pytest.TestReport]]()


@pytest.fixture
def attack(request: pytest.FixtureRequest) -> Iterator[Attack]:
    doc = (request.function.__doc__ or "").strip().splitlines()
    record = Attack(doc[0].strip() if doc else request.node.name)
    yield record
    path = os.environ.get(LOG_VARIABLE)
    if not path:
        return
    reports = request.node.stash.get(_RESULTS, [])
    passed = bool(reports) and all(r.passed for r in reports)
    line = {
        "test": request.node.nodeid,
        "attack": record.name,
        "outcome": "; ".join(record.outcomes) or "-",
        "effect": "; ".join(record.effects) or "-",
        "held": passed,
    }
    with open(path, "a", encoding="utf-8") as out:
        out.write(json.dumps(line) + "\n")
