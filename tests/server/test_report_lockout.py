"""The epoch bound cannot lock an honest volunteer out for good: one that trained alone far
past what the coordinator has stored is refused at first, then accepted again within a few
refreshes of the worker's view (a ReportGuard on a real SQLite database, on a stepped clock)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from sqlalchemy import select

from server.app import create_app
from server.clock import now_ms
from server.exceptions import ImplausibleReport
from server.models import Peer
from server.schemas import ReportCreate
from server.services import report_guard
from server.services.report_bounds import Bound, ReportLimits
from server.services.report_guard import ReportGuard
from server.services.reports import PendingReport, write_reports
from tests.server.conftest import Api, client_for, make_settings, running

LEAD = 100
AHEAD = 220  # epochs the volunteer ran alone before its reports reached the coordinator
REFRESH_S = 1.0
ONLINE_TTL_S = 60.0


async def test_a_volunteer_that_ran_ahead_alone_is_accepted_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    settings = make_settings(f"sqlite:///{tmp_path / 'coordinator.db'}")
    async with running(create_app(settings)) as app, client_for(app) as client:
        api = Api(client)
        run = await api.create_run()
        peer = await api.join(run["id"], (await api.create_join_token(run["id"]))["token"])
        factory = app.state.session_factory
        with factory() as session:
            peer_pk = session.scalars(
                select(Peer.id).where(Peer.peer_id == peer.body["peer_id"])
            ).one()

        clock = [now_ms()]
        monkeypatch.setattr(report_guard, "now_ms", lambda: clock[0])
        guard = ReportGuard(
            factory,
            ReportLimits(max_samples_per_second=1e6, max_epoch_lead=LEAD),
            refresh_s=REFRESH_S,
            online_ttl_s=ONLINE_TTL_S,
        )

        def write(report: PendingReport) -> None:
            with factory() as session, session.begin():
                write_reports(
                    session, [report], snapshot_interval_s=1e-3, online_ttl_s=ONLINE_TTL_S
                )

        def body(epoch: int) -> ReportCreate:
            return ReportCreate(epoch=epoch, samples=epoch, samples_per_second=1.0)

        write(await guard.admit(run["id"], peer_pk, body(0)))  # its first report, alone
        refused_views = 0
        for _ in range(10):
            clock[0] += int(REFRESH_S * 1000) + 1  # the view is old: a refusal reads it again
            outcomes = []
            for _ in range(5):  # several reports per view: the bound climbs per view only
                # The fast path never refuses (nor lifts): it hands the report to admit.
                assert guard.admit_known(run["id"], peer_pk, body(AHEAD)) is None
                try:
                    report = await guard.admit(run["id"], peer_pk, body(AHEAD))
                except ImplausibleReport as refused:
                    assert refused.bound is Bound.epoch
                    outcomes.append(False)
                else:
                    write(report)
                    outcomes.append(True)
                    break
            if outcomes[-1]:
                break
            refused_views += 1
        else:
            pytest.fail(f"epoch {AHEAD} still refused after {refused_views} refreshes")
        progress = (await client.get(f"/api/v1/runs/{run['id']}/progress")).json()

    # Refused on the views that could not yet allow it (100, then 200) — each lifting the
    # bound by the lead once, however many reports it refused — then accepted and stored.
    assert refused_views == math.ceil(AHEAD / LEAD) - 1
    assert progress["epoch"] == AHEAD
