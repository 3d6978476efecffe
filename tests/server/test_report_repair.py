"""A database whose report sums overflowed before the report bounds existed is repaired by
the migration: the pages and the progress API answer, with what honest peers reported.

The database is built at the revision before the repair, with what an attacker's reports
left in it then: 1,028 reports of 2^53 averaging rounds, epoch sums past 2^63 (SQLite keeps
such a sum as a float, and its ``sum()`` of them fails), losses and metrics of ±1e300 and
groups of a million."""

from __future__ import annotations

import datetime as dt
from typing import Any

import pytest
from alembic import command
from sqlalchemy import Engine, MetaData, Table, create_engine, func, insert, select, text
from sqlalchemy import types as sa_types

from server.app import create_app
from server.db import alembic_config
from tests.server.conftest import ORGANIZER, client_for, make_settings, running


@pytest.fixture
def database_url(empty_database_url: str) -> str:
    """These tests run the migrations themselves, from a database without tables."""
    return empty_database_url


BEFORE_REPAIR = "0007"
HONEST_ROUNDS = 3
# 1,028 reports over two epochs: each epoch's sum fits in 64 bits, their total does not.
ATTACK_SPLIT = (600, 428)
HUGE = 2**53


def _filler(column: Any) -> Any:
    """A value for a required column the test does not care about."""
    kind = column.type
    if isinstance(kind, sa_types.Boolean):
        return False
    if isinstance(kind, sa_types.Integer):
        return 0
    if isinstance(kind, sa_types.Float | sa_types.Numeric):
        return 0.0
    if isinstance(kind, sa_types.DateTime):
        return dt.datetime.now(dt.UTC)
    if isinstance(kind, sa_types.JSON):
        return {}
    if isinstance(kind, sa_types.LargeBinary):
        return b"\x01" * 32
    return "x"


def _row(table: Table, **values: Any) -> dict[str, Any]:
    """``values``, and a filler for every other column that needs one."""
    row = dict(values)
    for column in table.columns:
        generated = column.primary_key and isinstance(column.type, sa_types.Integer)
        needed = not column.nullable and column.server_default is None and not generated
        if column.name not in row and needed:
            row[column.name] = _filler(column)
    return row


def _build_attacked_database(engine: Engine) -> str:
    tables = MetaData()
    tables.reflect(engine)
    t = tables.tables
    now = int(dt.datetime.now(dt.UTC).timestamp() * 1000)
    run_id = "attackedrun"
    with engine.begin() as db:
        db.execute(
            insert(t["runs"]),
            _row(t["runs"], id=run_id, name="r", task="digits", status="running", config={}),
        )
        volunteer = db.execute(
            insert(t["volunteers"]).returning(t["volunteers"].c.id),
            _row(t["volunteers"], run_id=run_id, display_name="v"),
        ).scalar_one()
        peers = []
        for i, (loss, metric, group) in enumerate(
            [(2.0, 0.9, 2), (2.0, 0.9, 2), (2.0, 0.9, 2), (1e300, -1e300, 10**6)]
        ):
            peers.append(
                db.execute(
                    insert(t["peers"]).returning(t["peers"].c.id),
                    _row(
                        t["peers"],
                        run_id=run_id,
                        peer_id=f"peer{i}",
                        volunteer_id=volunteer,
                        addresses=[],
                        first_seen_ms=now - 60_000,
                        last_seen_ms=now,
                        last_report_ms=now,
                        epoch=1,
                        samples=1000,
                        samples_base=0,
                        samples_per_second=10.0,
                        loss=loss,
                        eval_metric=metric,
                        eval_metric_ms=now,
                        group_size=group,
                    ),
                ).scalar_one()
            )
        reports = t["progress_reports"]
        base = {
            "run_id": run_id,
            "reported_ms": now,
            "samples": 1000,
            "samples_per_second": 10.0,
            "rounds_failed": 0,
        }
        honest = [
            _row(
                reports,
                **base,
                peer_id=p,
                epoch=e,
                loss=2.0,
                group_size=2,
                rounds_done=HONEST_ROUNDS,
            )
            for p in peers[:3]
            for e in (0, 1)
        ]
        attack = [
            _row(
                reports,
                **base,
                peer_id=peers[3],
                epoch=epoch,
                loss=1e300,
                group_size=10**6,
                rounds_done=HUGE,
            )
            for epoch, count in enumerate(ATTACK_SPLIT)
            for _ in range(count)
        ]
        db.execute(insert(reports), honest + attack)
        summaries = t["epoch_summaries"]
        db.execute(
            insert(summaries),
            [
                _row(
                    summaries,
                    run_id=run_id,
                    epoch=0,
                    first_report_ms=now,
                    last_report_ms=now,
                    reports=3 + ATTACK_SPLIT[0],
                    loss_sum=6.0 + 1e300 * ATTACK_SPLIT[0],
                    loss_count=3 + ATTACK_SPLIT[0],
                    max_group_size=10**6,
                    rounds_done=3 * HONEST_ROUNDS + HUGE * ATTACK_SPLIT[0],
                    rounds_failed=0,
                ),
                _row(
                    summaries,
                    run_id=run_id,
                    epoch=1,
                    first_report_ms=now,
                    last_report_ms=now,
                    reports=3 + ATTACK_SPLIT[1],
                    loss_sum=6.0 + 1e300 * ATTACK_SPLIT[1],
                    loss_count=3 + ATTACK_SPLIT[1],
                    max_group_size=10**6,
                    rounds_done=3 * HONEST_ROUNDS + HUGE * ATTACK_SPLIT[1],
                    rounds_failed=0,
                ),
            ],
        )
        db.execute(
            insert(t["progress_snapshots"]),
            _row(
                t["progress_snapshots"],
                run_id=run_id,
                taken_ms=now - 1000,
                epoch=1,
                samples=4000,
                samples_per_second=40.0,
                loss=1e300,
                peers_online=4,
                eval_metric=-1e300,
                mean_group_size=250_001.5,
                rounds_done=2**62,
                rounds_failed=0,
            ),
        )
    return run_id


async def test_the_migration_repairs_sums_that_overflowed(database_url: str) -> None:
    config = alembic_config(database_url)
    command.upgrade(config, BEFORE_REPAIR)
    engine = create_engine(database_url)
    try:
        run_id = _build_attacked_database(engine)
        naive_sum = select(func.sum(text("rounds_done"))).select_from(text("epoch_summaries"))
        if engine.dialect.name == "sqlite":
            with engine.connect() as db, pytest.raises(Exception, match="overflow"):
                db.execute(naive_sum).scalar()  # what took the pages down
        command.upgrade(config, "head")
        with engine.connect() as db:
            # Even the naive sum answers now: every epoch was recounted from its reports.
            assert db.execute(naive_sum).scalar() == 6 * HONEST_ROUNDS
            rows = db.execute(
                text(
                    "SELECT epoch, max_group_size, loss_sum, loss_count FROM epoch_summaries "
                    "ORDER BY epoch"
                )
            ).all()
            assert [tuple(r) for r in rows] == [(0, 2, 6.0, 3), (1, 2, 6.0, 3)]
    finally:
        engine.dispose()

    settings = make_settings(database_url)
    async with running(create_app(settings)) as app, client_for(app) as client:
        for path in (
            "/api/v1/runs",
            "/api/v1/dashboard",
            f"/api/v1/runs/{run_id}/dashboard",
            f"/runs/{run_id}",
            "/",
        ):
            answer = await client.get(path, headers=ORGANIZER)
            assert answer.status_code == 200, (path, answer.text)
        progress = (await client.get(f"/api/v1/runs/{run_id}/progress")).json()
    assert progress["rounds_done"] == 6 * HONEST_ROUNDS
    assert progress["loss"] == 2.0 and progress["eval_metric"] == 0.9
    assert [e["mean_loss"] for e in progress["epochs"]] == [2.0, 2.0]
    assert [e["max_group_size"] for e in progress["epochs"]] == [2, 2]
    history = progress["history"]
    assert history[0]["loss"] is None and history[0]["rounds_done"] == 6 * HONEST_ROUNDS
    assert history[0]["mean_group_size"] is None
