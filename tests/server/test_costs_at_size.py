"""What a page costs the coordinator does not grow with the run: built for a run of 3,000
volunteers it sends the same statements to the database and reads back no more rows than
for 30 (a page of the volunteers' table aside). At 10,000 volunteers, work that grew with
the run was what failed: medians taken over every peer row in Python, and a volunteer's
page ranking every volunteer of the run to find its own place.

Rows are counted where they leave SQLite (a cursor that counts what it hands over), so a
query that moves the whole run into Python fails here whatever it looks like."""

from __future__ import annotations

import random
import sqlite3
import statistics
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from fastapi import FastAPI
from sqlalchemy import create_engine, event, insert, select
from sqlalchemy.orm import Session

from server.app import create_app
from server.clock import now_ms
from server.models import Peer, Run, Volunteer
from server.schemas import MAX_INT
from server.services import dashboard
from server.services.volunteer_table import DEFAULT_PER_PAGE, standing
from tests.server.conftest import Api, client_for, fresh_database, make_settings, running

SMALL, LARGE = 30, 3_000
TTL_S = 60.0


class _CountingCursor(sqlite3.Cursor):
    rows = 0  # handed over by every cursor since the last reset

    def fetchone(self) -> Any:
        row = super().fetchone()
        _CountingCursor.rows += row is not None
        return row

    def fetchmany(self, size: int | None = None) -> list[Any]:
        rows = super().fetchmany(self.arraysize if size is None else size)
        _CountingCursor.rows += len(rows)
        return rows

    def fetchall(self) -> list[Any]:
        rows = super().fetchall()
        _CountingCursor.rows += len(rows)
        return rows


class _CountingConnection(sqlite3.Connection):
    def cursor(self, factory: Any = _CountingCursor) -> Any:  # type: ignore[override]
        return super().cursor(factory)


def seed(session: Session, run_id: str, samples: list[int], now: int) -> list[int]:
    """One volunteer per entry, each with one online peer that has done that many samples;
    their ids, in order."""
    created = datetime.now(UTC)
    first = len(session.scalars(select(Volunteer.id).where(Volunteer.run_id == run_id)).all())
    session.execute(
        insert(Volunteer),
        [
            {"run_id": run_id, "display_name": f"v{first + i}", "created_at": created}
            for i in range(len(samples))
        ],
    )
    ids = list(
        session.scalars(
            select(Volunteer.id).where(Volunteer.run_id == run_id).order_by(Volunteer.id)
        )
    )[first:]
    rng = random.Random(len(samples))
    session.execute(
        insert(Peer),
        [
            {
                "run_id": run_id,
                "peer_id": f"peer-{volunteer}",
                "public_key": rng.randbytes(32),
                "volunteer_id": volunteer,
                "addresses": [],
                "first_seen_ms": now - 600_000,
                "last_seen_ms": now - rng.randrange(10_000),
                "last_report_ms": now - rng.randrange(10_000),
                "epoch": rng.randrange(5),
                "samples": count,
                "samples_per_second": 10.0,
                "loss": rng.uniform(0.5, 3.0),
                "group_size": 4,
                "eval_metric": rng.uniform(0.0, 1.0),
                "eval_metric_ms": now - rng.randrange(10_000),
            }
            for volunteer, count in zip(ids, samples, strict=True)
        ],
    )
    return ids


async def _run_with(url: str, volunteers: int) -> tuple[str, list[int]]:
    app = create_app(make_settings(url))
    async with running(app), client_for(app) as client:
        run = await Api(client).create_run(name=f"size-{volunteers}")
        rng = random.Random(volunteers)
        with app.state.session_factory() as session, session.begin():
            ids = seed(
                session, run["id"], [rng.randrange(10**6) for _ in range(volunteers)], now_ms()
            )
    return run["id"], ids


def _measured(url: str, build: Callable[[Session], Any]) -> tuple[int, int, Any]:
    """(statements, rows read back, result) of ``build`` on a fresh connection."""
    engine = create_engine(url, connect_args={"factory": _CountingConnection})
    statements = 0

    def count(*_: Any) -> None:
        nonlocal statements
        statements += 1

    try:
        with Session(engine) as session:
            session.execute(select(1))  # connected, so the count is the build's alone
            event.listen(engine, "before_cursor_execute", count)
            _CountingCursor.rows = 0
            result = build(session)
            return statements, _CountingCursor.rows, result
    finally:
        engine.dispose()


async def test_pages_cost_the_same_at_3000_volunteers_as_at_30(tmp_path: Path) -> None:
    costs: dict[int, dict[str, tuple[int, int]]] = {}
    for size in (SMALL, LARGE):
        (tmp_path / str(size)).mkdir()
        with fresh_database("sqlite", tmp_path / str(size)) as url:
            run_id, ids = await _run_with(url, size)

            def run(session: Session, run_id: str = run_id) -> Run:
                found = session.get(Run, run_id)
                assert found is not None
                return found

            builds: dict[str, Callable[[Session], Any]] = {
                "run dashboard": lambda s, run=run: dashboard.run_dashboard(
                    s, run(s), online_ttl_s=TTL_S, history_points=200
                ),
                "runs overview": lambda s: dashboard.runs_overview(s, online_ttl_s=TTL_S),
                "volunteer page": lambda s, run=run, me=ids[len(ids) // 2]: (
                    dashboard.volunteer_detail(s, run(s), str(me), online_ttl_s=TTL_S)
                ),
            }
            costs[size] = {}
            for name, build in builds.items():
                statements, rows, document = _measured(url, build)
                costs[size][name] = (statements, rows)
                if name == "run dashboard":
                    assert document.headline.peers_online == size  # every peer was read
                if name == "volunteer page":
                    assert document.volunteer.of == size
    for name, (statements, rows) in costs[LARGE].items():
        small_statements, small_rows = costs[SMALL][name]
        assert statements == small_statements, (name, costs)
        # the table's page grows from 30 rows to a full page; nothing else may
        assert rows <= small_rows + DEFAULT_PER_PAGE - SMALL, (name, costs)


@pytest.mark.parametrize("seed_value", [1, 2, 3])
async def test_a_volunteers_place_is_where_the_whole_table_would_rank_it(
    app: FastAPI, api: Api, seed_value: int
) -> None:
    rng = random.Random(seed_value)
    # ties, nobody's samples, and totals past what a JSON double holds exactly
    samples = [rng.choice([0, 5, 5, 7, 10**6, MAX_INT + 10]) for _ in range(40)]
    run = await api.create_run(name="ranks")
    now = now_ms()
    with app.state.session_factory() as session, session.begin():
        ids = seed(session, run["id"], samples, now)
        # a volunteer without a machine yet counts, with no samples
        (lone,) = seed(session, run["id"], [0], now)
        session.execute(Peer.__table__.delete().where(Peer.volunteer_id == lone))
    counted = {v: min(s, MAX_INT) for v, s in zip(ids, samples, strict=True)} | {lone: 0}
    table = sorted(counted, key=lambda v: (-counted[v], v))  # the table's order
    with app.state.session_factory() as session:
        for volunteer in [*rng.sample(ids, 10), lone]:
            place = standing(session, run["id"], volunteer, now - 60_000)
            assert place is not None
            assert place.row.id == volunteer and place.row.samples == counted[volunteer]
            assert place.rank == table.index(volunteer) + 1
            assert place.of == len(table)
            assert place.total_samples == pytest.approx(sum(counted.values()), rel=1e-12)
        assert standing(session, run["id"], max(counted) + 1, now) is None
        # the run's headline loss is the median of its online peers' (taken in SQL)
        losses = session.scalars(select(Peer.loss).where(Peer.run_id == run["id"])).all()
        found = session.get(Run, run["id"])
        assert found is not None
        document = dashboard.run_dashboard(session, found, online_ttl_s=TTL_S, history_points=50)
        assert document.headline.loss == pytest.approx(statistics.median(losses))
