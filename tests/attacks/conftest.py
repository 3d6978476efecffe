"""The standing attack suite: each test is one attack by a volunteer holding a valid invite.

A test takes the ``attack`` fixture and says, in words a reader of ``bench/redteam.py``'s
table understands, what the offender got (``attack.outcome(...)``: refused, excluded, capped)
and what the honest side saw (``attack.effect(...)``: unaffected, and by which measure). The
fixture's name is the test's docstring's first line. When ``SWARMGRAD_REDTEAM_LOG`` names a
file, one JSON line per attack is appended to it with the test's result, so the bench prints
the suite as a table without a second copy of any attack.

Attacks on the coordinator run against real ``swarmgrad coordinator`` processes, once per
backend: take ``coordinator`` (one process, default settings) or ``start_coordinator``
(call it, with settings as ``SWARMGRAD_...`` environment variables, for each process).
Such tests are multi-process: mark them ``slow``.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

from peer.formats.identity import Identity
from swarmgrad.local import LocalCoordinator
from tests.server.conftest import BACKENDS, bearer, fresh_database, join_proof

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


# ----------------------------------------------------------------------------- coordinators


@dataclass
class Volunteer:
    """A peer that joined through the public API: its key, peer token and join answer."""

    identity: Identity
    joined: dict[str, Any]

    @property
    def token(self) -> str:
        return str(self.joined["peer_token"])

    @property
    def headers(self) -> dict[str, str]:
        return bearer(self.token)


class Coordinator:
    """A real ``swarmgrad coordinator`` process (:class:`~swarmgrad.local.LocalCoordinator`)
    on one backend, with a synchronous client and short-hands for what attacks do through
    the public API: create a run and an invite as the organizer, join as a volunteer, report.
    """

    def __init__(self, backend: str, process: LocalCoordinator) -> None:
        self.backend = backend
        self.process = process
        self.url = process.url
        self.organizer = bearer(process.admin_token)
        self.http = httpx.Client(base_url=process.url, timeout=30.0)

    def create_run(self, name: str = "attacked", task: str = "digits", **config: Any) -> str:
        answer = self.http.post(
            "/api/v1/runs",
            json={"name": name, "task": task, "config": config},
            headers=self.organizer,
        )
        assert answer.status_code == 201, answer.text
        return str(answer.json()["id"])

    def invite(self, run_id: str, **body: Any) -> str:
        answer = self.http.post(f"/api/v1/runs/{run_id}/tokens", json=body, headers=self.organizer)
        assert answer.status_code == 201, answer.text
        return str(answer.json()["token"])

    def join(
        self,
        run_id: str,
        invite: str,
        identity: Identity | None = None,
        *,
        addresses: list[str] | None = None,
        client_mode: bool = True,
        display_name: str | None = None,
        expect: int = 200,
    ) -> Volunteer:
        """Join with a fresh key (or ``identity``); the answer's status must be ``expect``."""
        identity = identity or Identity()
        challenge = self.http.post("/api/v1/join/challenge", headers=bearer(invite))
        if challenge.status_code != 200:
            assert challenge.status_code == expect, challenge.text
            return Volunteer(identity, challenge.json())
        body: dict[str, Any] = {
            **join_proof(run_id, challenge.json()["challenge"], identity),
            "addresses": [] if addresses is None else addresses,
            "client_mode": client_mode,
        }
        if display_name is not None:
            body["display_name"] = display_name
        answer = self.http.post(f"/api/v1/runs/{run_id}/join", json=body, headers=bearer(invite))
        assert answer.status_code == expect, answer.text
        return Volunteer(identity, answer.json())

    def report(self, run_id: str, volunteer: Volunteer, **body: Any) -> httpx.Response:
        payload = {"epoch": 0, "samples": 0, "samples_per_second": 0.0, **body}
        return self.http.post(
            f"/api/v1/runs/{run_id}/reports", json=payload, headers=volunteer.headers
        )

    def log(self) -> str:
        """Everything the coordinator process logged so far."""
        return self.process.log()

    def close(self) -> None:
        self.http.close()
        self.process.stop()


CoordinatorFactory = Callable[..., Coordinator]


@pytest.fixture(params=BACKENDS)
def start_coordinator(
    request: pytest.FixtureRequest, tmp_path: Path
) -> Iterator[CoordinatorFactory]:
    """Start real coordinator processes on the test's backend (SQLite, PostgreSQL: the test
    runs once per backend; without PostgreSQL its half skips, or fails under ``CI=true``).
    Call it with settings as environment variables (``SWARMGRAD_...``) to override; every
    process it started is stopped, and its database removed, after the test."""
    started: list[Coordinator] = []
    with contextlib.ExitStack() as stack:
        database = stack.enter_context(fresh_database(request.param, tmp_path))

        def start(**env: str) -> Coordinator:
            directory = tmp_path / f"coordinator-{len(started)}"
            process = LocalCoordinator(directory, env={"SWARMGRAD_DATABASE_URL": database, **env})
            process.start()
            coordinator = Coordinator(str(request.param), process)
            started.append(coordinator)
            return coordinator

        try:
            yield start
        finally:
            for coordinator in started:
                coordinator.close()


@pytest.fixture
def coordinator(start_coordinator: CoordinatorFactory) -> Coordinator:
    """One real coordinator process with default settings, per backend."""
    return start_coordinator()
