"""CoordinatorSession against a fake coordinator (httpx.MockTransport) that can go away and
come back: reports, certificate renewal, status polling, bootstrap, close()."""

from __future__ import annotations

import base64
import itertools
import json
import logging
import random
import threading
import time
from collections.abc import Iterator
from datetime import UTC, datetime
from typing import Any

import httpx
import pytest

from peer.coordinator import CoordinatorClient, CoordinatorSession, SessionTimings
from peer.coordinator.session import _Backoff
from swarmlab.node_process import wait_until
from tests.conftest import scaled
from tests.peer.coordinator.answers import run_body

RUN = "/api/v1/runs/r1"
HEADER = {"X-Swarmgrad-Coordinator": "1"}
FAST = SessionTimings(poll_interval=0.05, retry_base=0.02, max_backoff=0.1, request_timeout=2.0)


class FakeCoordinator:
    """Answers the session's calls; ``up = False`` refuses every connection, ``failing``
    refuses the named routes only ("reports", "certificate", "status", "bootstrap",
    "leave")."""

    def __init__(self) -> None:
        self.up = True
        self.failing: set[str] = set()
        self.status = "running"
        self.status_detail: str | None = None
        self.reports: list[dict[str, Any]] = []
        self.report_answer: dict[int, tuple[int, str]] = {}  # epoch → (status, detail)
        self.calls: dict[str, list[float]] = {}
        self.certificate_ttl = 60.0
        self.renewals = 0
        self.addresses: list[str] = []
        self.gate: threading.Event | None = None  # reports wait on it when set
        self.revocations_serial = 0
        self.token_refused: str | None = None  # the 401 detail for every peer-token call

    def __call__(self, request: httpx.Request) -> httpx.Response:
        path = request.url.path.removeprefix(RUN)
        route = {"": "status", "/reports": "reports", "/certificate": "certificate"}.get(
            path, path.strip("/")
        )
        self.calls.setdefault(route, []).append(time.time())
        if not self.up or route in self.failing:
            raise httpx.ConnectError("[Errno 111] Connection refused")
        public = route in ("status", "revocations")
        assert request.headers["Authorization" if not public else "Host"]
        if not public and self.token_refused is not None:
            return self.answer(401, {"detail": self.token_refused})
        if route == "status":
            body = run_body(
                status=self.status,
                status_detail=self.status_detail,
                revocations_serial=self.revocations_serial,
            )
            return self.answer(200, body)
        if route == "revocations":
            serial = self.revocations_serial
            signed = base64.urlsafe_b64encode(f"list-{serial}".encode()).decode()
            return self.answer(200, {"serial": serial, "list": signed})
        if route == "reports":
            if self.gate is not None:
                self.gate.wait()
            body = json.loads(request.content)
            if body["epoch"] in self.report_answer:
                status, detail = self.report_answer[body["epoch"]]
                return self.answer(status, {"detail": detail})
            self.reports.append(body)
            return self.answer(202, {"status": "accepted"})
        if route == "certificate":
            self.renewals += 1
            expires = datetime.fromtimestamp(time.time() + self.certificate_ttl, UTC)
            return self.answer(
                200,
                {
                    "certificate": f"cert-{self.renewals}",
                    "certificate_expires_at": expires.isoformat(),
                },
            )
        if route == "leave":
            return httpx.Response(204, headers=HEADER)
        assert route == "bootstrap"
        return self.answer(200, {"peers": [{"peer_id": "x", "addresses": self.addresses}]})

    @staticmethod
    def answer(status: int, body: Any) -> httpx.Response:
        return httpx.Response(status, json=body, headers=HEADER)

    def count(self, route: str) -> int:
        return len(self.calls.get(route, ()))


@pytest.fixture
def fake() -> FakeCoordinator:
    return FakeCoordinator()


@pytest.fixture
def client(fake: FakeCoordinator) -> Iterator[CoordinatorClient]:
    with CoordinatorClient("http://coord.example", transport=httpx.MockTransport(fake)) as c:
        yield c


def session_for(client: CoordinatorClient, **kwargs: Any) -> CoordinatorSession:
    options: dict[str, Any] = {
        "run_id": "r1",
        "peer_token": "sgp_token",
        "certificate_expires_at": time.time() + 3600,
        "timings": FAST,
        "seed": 0,
    }
    options.update(kwargs)
    return CoordinatorSession(client, **options)


def report(epoch: int, **extra: Any) -> dict[str, Any]:
    return {"epoch": epoch, "samples": 10 * epoch, "samples_per_second": 1.0, **extra}


def session_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("swarmgrad-coordinator")]


# --------------------------------------------------------------------------- reports


def test_reports_go_out_in_order_and_submitting_never_waits_for_the_coordinator(
    fake: FakeCoordinator, client: CoordinatorClient
) -> None:
    fake.gate = threading.Event()  # the coordinator hangs on reports
    session = session_for(client)
    try:
        for epoch in range(1, 101):
            session.submit_report(report(epoch, rounds_done=1))
        # all 100 were queued while the first one is still stuck in the coordinator
        assert fake.reports == []
        fake.gate.set()
        assert wait_until(lambda: session.pending_reports == 0, scaled(10))
        epochs = [r["epoch"] for r in fake.reports]
        assert epochs == sorted(epochs) and epochs[-1] == 100
        assert sum(r["rounds_done"] for r in fake.reports) == 100
    finally:
        session.close()


def test_reports_wait_while_the_coordinator_is_away_and_flush_in_order_when_it_returns(
    fake: FakeCoordinator, client: CoordinatorClient, caplog: pytest.LogCaptureFixture
) -> None:
    fake.up = False
    with caplog.at_level(logging.INFO, logger="peer.coordinator"):
        session = session_for(client, max_reports=4)
        try:
            assert wait_until(lambda: not session.coordinator_reachable, scaled(10))
            for epoch in range(1, 11):
                session.submit_report(report(epoch, rounds_done=1, rounds_failed=epoch % 2))
            assert session.pending_reports == 4  # bounded: the oldest were merged
            assert fake.reports == []
            fake.up = True
            assert wait_until(lambda: session.pending_reports == 0, scaled(10))
            assert session.coordinator_reachable
        finally:
            session.close()
    epochs = [r["epoch"] for r in fake.reports]
    assert epochs == sorted(epochs) and epochs[-1] == 10 and len(epochs) == 4
    assert sum(r["rounds_done"] for r in fake.reports) == 10
    assert sum(r["rounds_failed"] for r in fake.reports) == 5
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "cannot reach the coordinator at coord.example" in warnings[0]
    assert "training goes on" in warnings[0]
    assert any("answers again" in r.getMessage() for r in caplog.records)
    assert "sgp_token" not in caplog.text


def test_a_refused_report_is_dropped_and_logged_once(
    fake: FakeCoordinator, client: CoordinatorClient, caplog: pytest.LogCaptureFixture
) -> None:
    fake.report_answer = {2: (422, "epoch: bad"), 3: (422, "epoch: bad")}
    with caplog.at_level(logging.WARNING, logger="peer.coordinator"):
        session = session_for(client)
        try:
            for epoch in range(1, 5):
                session.submit_report(report(epoch, loss=float("nan")))
            assert wait_until(lambda: session.pending_reports == 0, scaled(10))
        finally:
            session.close()
    assert [r["epoch"] for r in fake.reports] == [1, 4]
    assert all("loss" not in r for r in fake.reports)  # NaN became "unknown"
    refused = [r for r in caplog.records if "refused a progress report" in r.getMessage()]
    assert len(refused) == 1 and "epoch: bad" in refused[0].getMessage()


def test_a_finished_run_refusing_reports_makes_the_session_look_at_the_status(
    fake: FakeCoordinator, client: CoordinatorClient
) -> None:
    session = session_for(client, timings=SessionTimings(poll_interval=30.0, request_timeout=2))
    try:
        assert wait_until(lambda: session.status == "running", scaled(10))
        fake.status = "finished"
        fake.report_answer = {7: (409, "run r1 is finished")}
        session.submit_report(report(7))
        # the next poll is 30 s away, but the refusal brings it forward
        assert wait_until(lambda: session.status == "finished", scaled(10))
    finally:
        session.close()


# --------------------------------------------------------------------------- certificate


def test_the_certificate_is_renewed_when_a_third_of_its_lifetime_remains(
    fake: FakeCoordinator, client: CoordinatorClient
) -> None:
    lifetime = 0.9
    fake.certificate_ttl = lifetime
    renewed: list[tuple[str, float]] = []
    start = time.time()
    session = session_for(
        client,
        certificate_expires_at=start + lifetime,
        on_certificate=lambda cert, expires: renewed.append((cert, expires)),
    )
    try:
        assert wait_until(lambda: len(renewed) >= 2, scaled(10))
        assert [cert for cert, _ in renewed[:2]] == ["cert-1", "cert-2"]
        first_call = fake.calls["certificate"][0]
        assert first_call >= start + lifetime * 2 / 3 - 0.05  # not before a third remains
        assert session.certificate_expires_at >= renewed[0][1]
    finally:
        session.close()


def test_a_failing_renewal_warns_once_keeps_trying_and_says_when_it_recovers(
    fake: FakeCoordinator, client: CoordinatorClient, caplog: pytest.LogCaptureFixture
) -> None:
    fake.failing = {"certificate"}
    renewed: list[str] = []
    expires = time.time() + 0.3
    with caplog.at_level(logging.INFO, logger="peer.coordinator"):
        session = session_for(
            client,
            certificate_expires_at=expires,
            on_certificate=lambda cert, _: renewed.append(cert),
        )
        try:
            assert wait_until(lambda: fake.count("certificate") >= 4, scaled(10))
            assert renewed == []
            fake.failing = set()
            assert wait_until(lambda: renewed, scaled(10))
        finally:
            session.close()
    messages = [r.getMessage() for r in caplog.records]
    warned = [m for m in messages if "cannot renew the run certificate" in m]
    hhmm = time.strftime("%H:%M", time.localtime(expires))
    assert len(warned) == 1 and f"live links continue until {hhmm}" in warned[0]
    assert "\n" not in warned[0]
    assert any(m.startswith("renewed the run certificate; valid until") for m in messages)


def test_a_refused_peer_token_stops_renewals_and_leaving_and_says_to_join_again(
    fake: FakeCoordinator, client: CoordinatorClient, caplog: pytest.LogCaptureFixture
) -> None:
    fake.token_refused = "this peer token expired at 2026-01-01T00:00:00+00:00"
    lost: list[str] = []
    with caplog.at_level(logging.WARNING, logger="peer.coordinator"):
        session = session_for(
            client, certificate_expires_at=time.time() + 0.3, on_credentials_lost=lost.append
        )
        try:
            session.submit_report(report(1))
            assert wait_until(lambda: session.credentials_lost is not None, scaled(10))
            # Told once, whichever call found out; renewing is over.
            assert wait_until(lambda: session.pending_reports == 0, scaled(10))
            renewals = fake.count("certificate")
            session.submit_report(report(2))
            assert wait_until(lambda: fake.count("reports") >= 2, scaled(10))
            assert fake.count("certificate") == renewals <= 1
        finally:
            session.close()
    (line,) = lost
    assert line == session.credentials_lost
    assert fake.count("leave") == 0  # no goodbye with a token the coordinator refused
    assert fake.token_refused in line and "invite" in line
    assert "swarmgrad join http://coord.example --token INVITE" in line and "\n" not in line
    assert "sgp_token" not in line
    assert [r.getMessage() for r in caplog.records if "no longer accepts" in r.getMessage()] == [
        line
    ]


# --------------------------------------------------------------------------- status


def test_status_changes_are_seen_and_reported(
    fake: FakeCoordinator, client: CoordinatorClient
) -> None:
    seen: list[str] = []
    session = session_for(client, status="running", on_status=seen.append)
    try:
        assert wait_until(lambda: fake.count("status") >= 2, scaled(10))
        assert seen == [] and session.status == "running"  # known from the join: no change
        fake.status = "paused"
        assert wait_until(lambda: seen == ["paused"], scaled(10))
        fake.status = "running"
        assert wait_until(lambda: seen == ["paused", "running"], scaled(10))
        assert session.status == "running"
    finally:
        session.close()


def test_a_hint_reads_the_status_at_once_but_at_most_once_per_poll_interval(
    fake: FakeCoordinator, client: CoordinatorClient
) -> None:
    """A paused peer that sees the others train asks for the status now; however often it
    is told, the coordinator is asked at most twice per poll interval."""
    seen: list[str] = []
    fake.status = "paused"
    timings = SessionTimings(poll_interval=30.0, request_timeout=2.0)
    session = session_for(client, status="paused", on_status=seen.append, timings=timings)
    try:
        assert wait_until(lambda: fake.count("status") == 1, scaled(10))  # the first poll
        fake.status = "running"
        session.poll_soon()
        assert wait_until(lambda: seen == ["running"], scaled(10))
        for _ in range(50):  # a swarm that claims a lot is heard once per interval
            session.poll_soon()
        assert not wait_until(lambda: fake.count("status") > 2, 0.3)
        assert fake.count("status") == 2
    finally:
        session.close()


def test_why_the_run_waits_is_seen_while_its_status_stays(
    fake: FakeCoordinator, client: CoordinatorClient
) -> None:
    fake.status, fake.status_detail = "paused", "waiting for 3 volunteers (1 online)"
    session = session_for(client, status="paused")
    try:
        assert wait_until(lambda: session.status_detail == fake.status_detail, scaled(10))
        fake.status_detail = "waiting for 3 volunteers (2 online)"
        assert wait_until(lambda: session.status_detail == fake.status_detail, scaled(10))
        fake.status, fake.status_detail = "running", None
        assert wait_until(lambda: session.status_detail is None, scaled(10))
        assert session.status == "running"
    finally:
        session.close()


def test_a_new_revocation_list_is_fetched_once_and_handed_on_until_taken(
    fake: FakeCoordinator, client: CoordinatorClient
) -> None:
    """No bans: nothing fetched. A ban: the list is fetched and handed to the node; a node
    that fails to take it is given it again at the next poll; then no more fetches until
    the serial grows."""
    handed: list[bytes] = []
    failures = [RuntimeError("not now")]

    def take(data: bytes) -> None:
        if failures:
            raise failures.pop()
        handed.append(data)

    session = session_for(client, on_revocations=take)
    try:
        assert wait_until(lambda: fake.count("status") >= 3, scaled(10))
        assert fake.count("revocations") == 0
        fake.revocations_serial = 7
        assert wait_until(lambda: len(handed) == 1, scaled(10))
        polls = fake.count("status")
        assert wait_until(lambda: fake.count("status") >= polls + 3, scaled(10))
        assert fake.count("revocations") == 2 and handed == [b"list-7"]
        fake.revocations_serial = 9
        assert wait_until(lambda: len(handed) == 2, scaled(10))
        assert fake.count("revocations") == 3
    finally:
        session.close()


def test_status_polls_back_off_while_the_coordinator_is_away(
    fake: FakeCoordinator, client: CoordinatorClient
) -> None:
    fake.up = False
    timings = SessionTimings(poll_interval=0.05, retry_base=0.05, max_backoff=0.4)
    session = session_for(client, timings=timings)
    try:
        assert wait_until(lambda: fake.count("status") >= 5, scaled(20))
        calls = fake.calls["status"][:5]
        gaps = [b - a for a, b in itertools.pairwise(calls)]
        for k, gap in enumerate(gaps):
            assert gap >= 0.8 * min(0.4, 0.05 * 2**k) - 0.01  # 0.05, 0.1, 0.2, 0.4 (±20 %)
        fake.up = True
        assert wait_until(lambda: session.coordinator_reachable, scaled(10))
    finally:
        session.close()


def test_backoff_doubles_to_its_cap_and_resets() -> None:
    backoff = _Backoff(1.0, 10.0, random.Random(0))
    delays = [backoff.failed() for _ in range(6)]
    for k, delay in enumerate(delays):
        assert 0.8 * min(10, 2**k) <= delay <= 1.2 * min(10, 2**k)
    backoff.reset()
    assert backoff.failed() <= 1.2


# --------------------------------------------------------------------------- bootstrap


def test_bootstrap_is_asked_only_while_the_node_is_alone(
    fake: FakeCoordinator, client: CoordinatorClient
) -> None:
    alone = threading.Event()
    handed: list[list[str]] = []
    fake.addresses = ["ws://10.0.0.2:4000"]

    def on_bootstrap(addresses: list[str]) -> None:
        handed.append(addresses)
        alone.clear()  # the node reconnected

    session = session_for(client, needs_bootstrap=alone.is_set, on_bootstrap=on_bootstrap)
    try:
        assert wait_until(lambda: fake.count("status") >= 3, scaled(10))
        assert fake.count("bootstrap") == 0 and handed == []
        alone.set()
        assert wait_until(lambda: handed == [["ws://10.0.0.2:4000"]], scaled(10))
        asked = fake.count("bootstrap")
        assert wait_until(lambda: fake.count("status") >= 8, scaled(10))
        assert fake.count("bootstrap") == asked == 1
    finally:
        session.close()


# --------------------------------------------------------------------------- robustness


def test_a_failing_callback_is_logged_and_the_session_goes_on(
    fake: FakeCoordinator, client: CoordinatorClient, caplog: pytest.LogCaptureFixture
) -> None:
    def broken(status: str) -> None:
        raise RuntimeError("callback bug")

    with caplog.at_level(logging.ERROR, logger="peer.coordinator"):
        session = session_for(client, on_status=broken)
        try:
            assert wait_until(lambda: "callback bug" in caplog.text, scaled(10))
            session.submit_report(report(1))
            assert wait_until(lambda: len(fake.reports) == 1, scaled(10))
        finally:
            session.close()


def test_close_flushes_what_is_queued_and_leaves_no_thread(
    fake: FakeCoordinator, client: CoordinatorClient
) -> None:
    fake.gate = threading.Event()
    session = session_for(client)
    for epoch in range(1, 6):
        session.submit_report(report(epoch))
    fake.gate.set()
    session.close()
    assert [r["epoch"] for r in fake.reports] == [1, 2, 3, 4, 5]
    assert session_threads() == []
    session.close()  # idempotent
    session.submit_report(report(6))  # after close: dropped, not raised
    assert len(fake.reports) == 5


def test_close_says_the_peer_leaves_once_after_the_last_report(
    fake: FakeCoordinator, client: CoordinatorClient
) -> None:
    session = session_for(client)
    session.submit_report(report(1))
    session.close()
    session.close()  # idempotent: one goodbye
    assert fake.count("leave") == 1
    assert fake.calls["leave"][0] >= fake.calls["reports"][-1]
    assert [r["epoch"] for r in fake.reports] == [1]


def test_a_leave_the_coordinator_does_not_take_is_only_logged(
    fake: FakeCoordinator, client: CoordinatorClient, caplog: pytest.LogCaptureFixture
) -> None:
    fake.failing = {"leave"}
    session = session_for(client)
    with caplog.at_level(logging.INFO, logger="peer.coordinator"):
        session.close()
    assert fake.count("leave") == 1
    assert session_threads() == []
    assert "could not tell the coordinator this peer leaves" in caplog.text
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


def test_close_keeps_its_deadline_when_the_coordinator_is_away(
    fake: FakeCoordinator, client: CoordinatorClient, caplog: pytest.LogCaptureFixture
) -> None:
    fake.up = False
    session = session_for(client)
    assert wait_until(lambda: not session.coordinator_reachable, scaled(10))
    for epoch in range(3):
        session.submit_report(report(epoch))
    started = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="peer.coordinator"):
        session.close(flush_timeout=0.2)
    assert time.monotonic() - started < scaled(3)
    assert session_threads() == []
    assert "3 progress report(s) not sent" in caplog.text


def test_timings_are_checked() -> None:
    with pytest.raises(ValueError):
        SessionTimings(poll_interval=0)
    with pytest.raises(ValueError):
        SessionTimings(retry_base=5, max_backoff=1)
    with pytest.raises(ValueError):
        SessionTimings(request_timeout=0)


def test_a_node_cut_off_from_the_swarm_rejoins_through_the_session(
    fake: FakeCoordinator, client: CoordinatorClient
) -> None:
    """The wiring a volunteer uses: ``needs_bootstrap`` counts the node's links and
    ``on_bootstrap`` is ``Node.add_initial_peers``."""
    from peer import Node

    fast = {"gossip_period": 0.2, "request_timeout": 3.0}
    with Node(**fast) as lonely, Node(**fast) as other:
        fake.addresses = other.visible_addresses
        session = session_for(
            client,
            needs_bootstrap=lambda: lonely.num_links == 0,
            on_bootstrap=lonely.add_initial_peers,
        )
        try:
            assert wait_until(lambda: lonely.peer_id in other.members(), scaled(10))
            assert fake.count("bootstrap") >= 1
        finally:
            session.close()


def test_a_bug_below_is_logged_without_spinning(
    fake: FakeCoordinator, client: CoordinatorClient, caplog: pytest.LogCaptureFixture
) -> None:
    def broken(run_id: str) -> dict[str, Any]:
        raise RuntimeError("surprise")

    client.run = broken  # type: ignore[method-assign]
    timings = SessionTimings(poll_interval=0.05, retry_base=0.02, max_backoff=30)
    with caplog.at_level(logging.ERROR, logger="peer.coordinator"):
        session = session_for(client, timings=timings)
        try:
            assert wait_until(lambda: "surprise" in caplog.text, scaled(10))
            session.submit_report(report(1))  # the rest goes on
            assert wait_until(lambda: len(fake.reports) == 1, scaled(10))
        finally:
            session.close()
    failed = [r for r in caplog.records if "poll_status failed" in r.getMessage()]
    assert len(failed) == 1  # retried after max_backoff, not at once


def test_bad_arguments_fail_in_the_callers_thread(client: CoordinatorClient) -> None:
    with pytest.raises(ValueError, match="token"):
        session_for(client, peer_token="")
    with pytest.raises(ValueError, match="run_id"):
        session_for(client, run_id="")
    assert session_threads() == []
