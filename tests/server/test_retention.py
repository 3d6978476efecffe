"""Report retention: old raw reports are folded into rollups and deleted, the pages read the
same before and after, the job runs without reports arriving, and one worker runs it at a
time (SQLite and PostgreSQL)."""

from __future__ import annotations

import asyncio
import random
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi import FastAPI
from sqlalchemy import func, select
from sqlalchemy.orm import Session, sessionmaker

from server.app import create_app
from server.clock import now_ms
from server.config import Settings
from server.db import make_engine, make_session_factory
from server.models import Peer, ProgressReport, ReportRollup, Run
from server.services import dashboard, progress
from server.services.report_buffer import ReportBuffer
from server.services.reports import PendingReport, write_reports
from server.services.retention import ReportRetention, claim
from server.services.rollups import combine, contribution, single, summarize
from swarmlab.node_process import wait_until
from tests.conftest import scaled
from tests.server.conftest import Api, client_for, make_settings, running

DAY_MS = 24 * 3600 * 1000
NOW = 1_900_000_000_000  # the injected clock: every report is older
RETENTION_S = 3 * 24 * 3600.0  # reports of the last 3 of 10 days stay raw
TTL_S = 60.0


def test_buckets_folded_in_pieces_are_the_buckets_of_all_reports() -> None:
    rng = random.Random(7)
    reports, t, samples = [], 0, 0
    for _ in range(400):
        t += rng.randint(1, 30_000)
        samples = rng.randint(0, 9) if rng.random() < 0.1 else samples + rng.randint(0, 50)
        reports.append((rng.randint(1, 3), t, samples))
    whole = summarize(reports, 60_000)
    for cut in (1, 57, 200, 399):  # the retention job's batches split buckets anywhere
        pieces = combine(summarize(reports[:cut], 60_000), summarize(reports[cut:], 60_000))
        assert sorted(pieces, key=lambda b: (b.peer_pk, b.bucket_ms)) == whole
    series, sessions = contribution(whole, 60.0, 50)
    one_by_one, same = contribution([single(*r) for r in reports], 60.0, 10_000)
    assert sessions == same  # a bucket no wider than the online TTL keeps every session
    assert series.samples[-1] == one_by_one.samples[-1]  # and every sample


@pytest.fixture
def settings(database_url: str, tmp_path: Path) -> Settings:
    # The app's own retention job is off: these tests drive theirs with the injected clock.
    return make_settings(database_url, report_retention_s=None, peer_online_ttl_s=TTL_S)


def history(run_id: str, peer_pk: int, seed: int, end: int) -> list[PendingReport]:
    """Ten days of sessions: reports 5-40 s apart, offline gaps of 2 min to 6 h, a counter
    that restarts from zero now and then, group sizes often missing."""
    rng = random.Random(seed)
    t, samples, reports = end - 10 * DAY_MS, 0, []
    while t < end - 1000:
        for _ in range(rng.randint(2, 10)):
            samples = rng.randint(0, 20) if rng.random() < 0.05 else samples + rng.randint(1, 99)
            group = rng.choice([None, None, 2, 3])
            reports.append(
                PendingReport(run_id, peer_pk, t, epoch=0, samples=samples,
                              samples_per_second=4.0, loss=1.0, group_size=group)
            )  # fmt: skip
            t += rng.randint(5_000, 40_000)
        t += rng.randint(120_000, 6 * 3600_000)
    return [r for r in reports if r.reported_ms < end]


async def seeded_run(app: FastAPI, end: int = NOW) -> str:
    """A run with two volunteers and ten days of their reports until ``end``; returns its
    id."""
    async with client_for(app) as client:
        api = Api(client)
        run_id = (await api.create_run())["id"]
        token = (await api.create_join_token(run_id))["token"]
        for name in ("ada", "bob"):
            await api.join(run_id, token, display_name=name)
    factory = app.state.session_factory
    with factory() as session:
        peers = list(session.scalars(select(Peer.id).where(Peer.run_id == run_id)))
        reports = sorted(
            (r for i, pk in enumerate(peers) for r in history(run_id, pk, seed=i, end=end)),
            key=lambda r: r.reported_ms,
        )
        for start in range(0, len(reports), 500):
            write_reports(session, reports[start : start + 500], snapshot_interval_s=5.0,
                          online_ttl_s=TTL_S)  # fmt: skip
        session.commit()
    return run_id


def raw_reports(factory: sessionmaker[Session]) -> int:
    with factory() as session:
        return int(session.scalar(select(func.count()).select_from(ProgressReport)) or 0)


def retention(factory: sessionmaker[Session], clock: Any = lambda: NOW, **extra: Any) -> Any:
    return ReportRetention(factory, retention_s=RETENTION_S, interval_s=3600.0,
                           online_ttl_s=TTL_S, clock=clock, **extra)  # fmt: skip


@pytest.fixture
def frozen(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setattr(dashboard, "now_ms", lambda: NOW)
    monkeypatch.setattr(progress, "now_ms", lambda: NOW)
    yield


def pages(factory: sessionmaker[Session], run_id: str) -> list[dict[str, Any]]:
    with factory() as session:
        run = session.get(Run, run_id)
        assert run is not None
        documents = [
            dashboard.run_dashboard(session, run, online_ttl_s=TTL_S, history_points=50),
            progress.progress(session, run, online_ttl_s=TTL_S, history_points=50),
        ]
        for name in ("ada", "bob"):
            documents.append(
                dashboard.volunteer_detail(
                    session, run, name, online_ttl_s=TTL_S, retention_s=RETENTION_S
                )
            )
        return [d.model_dump() for d in documents]


async def test_pruning_leaves_the_pages_as_they_were(app: FastAPI, frozen: None) -> None:
    factory = app.state.session_factory
    run_id = await seeded_run(app)
    idle = await seeded_run(app, end=NOW - 5 * DAY_MS)  # even its newest reports are old
    before, stored = pages(factory, run_id) + pages(factory, idle), raw_reports(factory)
    counted: list[int] = []
    job = retention(factory, on_pruned=counted.append, batch=97)  # batches split buckets

    pruned = await asyncio.to_thread(job.run, threading.Event())

    assert pruned > stored // 2 and sum(counted) == pruned and len(counted) > 1
    assert raw_reports(factory) == stored - pruned
    with factory() as session:
        assert session.scalar(select(func.count()).select_from(ReportRollup))
    after = pages(factory, run_id) + pages(factory, idle)
    for document, again in zip(before, after, strict=True):
        assert again == document
    volunteer = after[2]
    assert len(volunteer["series"]["samples"]) > 100 and len(volunteer["sessions"]) > 10
    assert volunteer["series"]["samples"] == sorted(volunteer["series"]["samples"])
    assert len(after[0]["group_sizes"]["recent"]) > 50  # the 200 newest reports, kept
    assert len(after[4]["group_sizes"]["recent"]) > 50 and after[5]["recent_group_sizes"]
    with factory() as session:  # kept for those, but already counted in the rollups
        assert session.scalar(select(func.count()).where(ProgressReport.rolled_up.is_(True)))
    assert await asyncio.to_thread(job.run, threading.Event()) == 0  # not due again yet


async def test_pruning_runs_without_reports_arriving(app: FastAPI) -> None:
    factory = app.state.session_factory
    await seeded_run(app)
    stored = raw_reports(factory)
    counted: list[int] = []
    buffer = ReportBuffer(factory, flush_interval_s=0.05, max_pending=100,
                          snapshot_interval_s=5.0, online_ttl_s=TTL_S,
                          housekeeping=retention(factory, on_pruned=counted.append))  # fmt: skip
    async with buffer:
        assert await asyncio.to_thread(wait_until, lambda: counted, scaled(10))
    assert raw_reports(factory) < stored


async def test_the_app_prunes_and_counts_in_metrics(settings: Settings) -> None:
    async with running(create_app(settings)) as first:
        await seeded_run(first, end=now_ms())  # the app's clock is the real one
        stored = raw_reports(first.state.session_factory)
    pruning = settings.model_copy(update={"report_retention_s": RETENTION_S})
    async with running(create_app(pruning)) as second:
        factory = second.state.session_factory
        assert await asyncio.to_thread(
            wait_until, lambda: raw_reports(factory) < stored, scaled(10)
        )
        async with client_for(second) as client:
            text = (await client.get("/metrics")).text
    line = next(x for x in text.splitlines() if x.startswith("swarmgrad_process_reports_pruned"))
    assert float(line.split()[-1]) > 0


def race(barrier: threading.Barrier, factory: sessionmaker[Session], name: str, now: int) -> bool:
    barrier.wait()
    return claim(factory, name, now, 3_600_000)


async def test_two_workers_never_prune_at_once(app: FastAPI, settings: Settings) -> None:
    first = app.state.session_factory
    engine = make_engine(settings)  # a second worker: its own connections
    second = make_session_factory(engine)
    try:
        for round_ in range(5):  # a race for a job never run, then for one due again
            for now in (NOW, NOW + 3_600_000):
                barrier = threading.Barrier(2)
                won = await asyncio.gather(
                    *(
                        asyncio.to_thread(race, barrier, factory, f"race-{round_}", now)
                        for factory in (first, second)
                    )
                )
                assert sorted(won) == [False, True]

        await seeded_run(app)
        stored = raw_reports(first)
        clock = [NOW]
        one, other = retention(first, lambda: clock[0]), retention(second, lambda: clock[0])
        pruned = one.run(threading.Event())
        assert pruned > 0
        await seeded_run(app)  # more old reports, yet the job is not due for another hour
        assert other.run(threading.Event()) == 0
        assert raw_reports(first) == 2 * stored - pruned
        clock[0] += 3_600_000
        assert other.run(threading.Event()) > 0
    finally:
        engine.dispose()
