"""The run's sums saturate instead of overflowing, on both databases: even reports written
past every admission bound (stale workers, a spill written before the bounds) leave the
pages and the progress API answering, with the counters at MAX_INT."""

from __future__ import annotations

import sqlite3
from typing import Any

import httpx
from fastapi import FastAPI
from sqlalchemy import exc, select

from server.clock import now_ms
from server.models import Peer
from server.schemas import MAX_INT
from server.services.report_buffer import database_unavailable
from server.services.reports import PendingReport, write_reports
from server.services.run_totals import saturated
from tests.server.conftest import ORGANIZER, Api


def test_saturated_reads_any_sum_back_within_bounds() -> None:
    assert saturated(None) == 0
    assert saturated(12) == 12
    assert saturated(2.0**70) == MAX_INT
    assert saturated(float("inf")) == MAX_INT
    assert saturated(-5) == 0


async def test_rounds_past_every_bound_saturate(
    app: FastAPI, api: Api, client: httpx.AsyncClient, run: dict[str, Any], join_token: str
) -> None:
    """1,028 reports of 2^53 rounds over two epochs, from four peers, written directly."""
    peers = [await api.join(run["id"], join_token) for _ in range(4)]
    factory = app.state.session_factory
    with factory() as session:
        pks = [
            session.scalars(select(Peer.id).where(Peer.peer_id == p.body["peer_id"])).one()
            for p in peers
        ]
    t = now_ms()
    for start in range(0, 1028, 257):
        batch = [
            PendingReport(run["id"], pks[start // 257], t + i, i % 2, 10, 1.0, None, None,
                          rounds_done=MAX_INT, rounds_failed=MAX_INT)
            for i in range(start, start + 257)
        ]  # fmt: skip
        with factory() as session, session.begin():
            write_reports(session, batch, snapshot_interval_s=1e-6, online_ttl_s=60)
    for path in ("/api/v1/runs", f"/api/v1/runs/{run['id']}/dashboard", f"/runs/{run['id']}"):
        answer = await client.get(path, headers=ORGANIZER)
        assert answer.status_code == 200, (path, answer.text)
    progress = (await client.get(f"/api/v1/runs/{run['id']}/progress")).json()
    assert progress["rounds_done"] == MAX_INT and progress["rounds_failed"] == MAX_INT
    assert [e["rounds_done"] for e in progress["epochs"]] == [MAX_INT, MAX_INT]
    assert progress["history"][-1]["rounds_done"] == MAX_INT


def test_an_overflow_is_never_taken_for_the_database_being_unavailable() -> None:
    overflow = exc.OperationalError(
        "SELECT sum(x)", {}, sqlite3.OperationalError("integer overflow")
    )
    assert not database_unavailable(overflow)
    locked = exc.OperationalError("UPDATE", {}, sqlite3.OperationalError("database is locked"))
    assert database_unavailable(locked)
