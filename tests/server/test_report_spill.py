"""Writing reports when things fail: a bad row costs only itself; reports acknowledged while
the database is unavailable are spilled to disk and written when it returns, or replayed by
the next coordinator to start — each exactly once."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi import FastAPI
from sqlalchemy import Engine, event, func, select

from server.app import create_app
from server.clock import now_ms
from server.models import Peer, ProgressReport, SpilledSegment
from server.services.report_buffer import ReportBuffer
from server.services.report_spill import ReportSpill
from server.services.reports import PendingReport
from swarmlab.node_process import wait_until
from tests.conftest import scaled
from tests.server.conftest import Api, client_for, make_settings, running


@contextlib.contextmanager
def database_down(engine: Engine) -> Iterator[None]:
    """Every statement of ``engine`` fails as a lost connection would, until the block ends."""
    error = engine.dialect.loaded_dbapi.OperationalError

    def fail(*_: Any) -> None:
        raise error("the database is unavailable (injected by a test)")

    event.listen(engine, "before_cursor_execute", fail)
    try:
        yield
    finally:
        event.remove(engine, "before_cursor_execute", fail)


def stored(app: FastAPI) -> int:
    with app.state.session_factory() as session:
        return int(session.scalar(select(func.count()).select_from(ProgressReport)) or 0)


def spilled_lines(directory: Path) -> int:
    return sum(len(p.read_bytes().splitlines()) for p in directory.glob("*.jsonl"))


async def _joined(api: Api) -> tuple[dict[str, Any], Any]:
    run = await api.create_run()
    peer = await api.join(run["id"], (await api.create_join_token(run["id"]))["token"])
    return run, peer


async def test_a_batch_with_one_bad_row_writes_the_others(
    app: FastAPI, api: Api, caplog: pytest.LogCaptureFixture
) -> None:
    run, joined = await _joined(api)
    with app.state.session_factory() as session:
        pk = session.scalars(select(Peer.id).where(Peer.peer_id == joined.body["peer_id"])).one()
    buffer = ReportBuffer(
        app.state.session_factory,
        flush_interval_s=3600,
        max_pending=100,
        snapshot_interval_s=5,
        online_ttl_s=60,
    )
    t = now_ms()
    for i in range(3):
        await buffer.add(PendingReport(run["id"], pk, t + i, 0, i, 1.0, None, None))
    # A peer that does not exist (its row deleted meanwhile, say): the foreign key refuses it.
    await buffer.add(PendingReport(run["id"], 987654, t, 0, 1, 1.0, None, None))
    with caplog.at_level(logging.ERROR, logger="server.services.report_buffer"):
        assert await buffer.flush() == 3
    assert stored(app) == 3 and buffer.pending == 0
    assert any("row 987654" in r.getMessage() for r in caplog.records), caplog.text
    await buffer.close()


async def test_reports_acknowledged_while_the_database_is_down_are_written_after(
    database_url: str, tmp_path: Path
) -> None:
    spill = tmp_path / "spill"
    settings = make_settings(database_url, spill_dir=spill, peer_auth_cache_ttl_s=3600)
    async with running(create_app(settings)) as app, client_for(app) as client:
        api = Api(client)
        run, peer = await _joined(api)
        assert (await api.report(run["id"], peer, samples=1)).status_code == 202  # cached now
        await app.state.report_buffer.flush()
        with database_down(app.state.engine):
            for samples in range(2, 12):
                assert (await api.report(run["id"], peer, samples=samples)).status_code == 202
            await app.state.report_buffer.flush()
            assert spilled_lines(spill) == 10 and app.state.report_buffer.pending == 0
        # The flusher writes them once its back-off is over.
        assert await asyncio.to_thread(wait_until, lambda: stored(app) == 11, scaled(20))
        # The rows are visible once the replay commits; the segment and its record go just
        # after, in the same flush: taking the flush lock waits for it to end.
        await app.state.report_buffer.flush()
        assert spilled_lines(spill) == 0
        with app.state.session_factory() as session:
            assert session.scalar(select(func.count()).select_from(SpilledSegment)) == 0
            assert session.scalar(select(Peer.samples).where(Peer.run_id == run["id"])) == 11


async def test_a_restart_replays_what_was_spilled(database_url: str, tmp_path: Path) -> None:
    """The first coordinator loses its database and then stops: what it acknowledged is in
    the spill, and the next one writes it."""
    spill = tmp_path / "spill"
    settings = make_settings(
        database_url, spill_dir=spill, peer_auth_cache_ttl_s=3600, report_flush_interval_s=3600
    )
    async with running(create_app(settings)) as first, client_for(first) as client:
        api = Api(client)
        run, peer = await _joined(api)
        assert (await api.report(run["id"], peer, samples=1)).status_code == 202
        await first.state.report_buffer.flush()
        with database_down(first.state.engine):
            for samples in range(2, 7):
                assert (await api.report(run["id"], peer, samples=samples)).status_code == 202
            await first.state.report_buffer.close()  # the shutdown's flush, database down
        assert spilled_lines(spill) == 5

        assert stored(first) == 1  # its lifespan's own shutdown found the buffer closed

    async with running(create_app(settings)) as second:
        await second.state.report_buffer.flush()  # the first flush replays the spill
        assert stored(second) == 6 and spilled_lines(spill) == 0


async def test_a_spilled_line_is_written_once(app: FastAPI, api: Api, tmp_path: Path) -> None:
    """A worker that died after writing a segment's lines, before removing the file: the
    lines already recorded as written are not written again."""
    run, joined = await _joined(api)
    with app.state.session_factory() as session:
        pk = session.scalars(select(Peer.id).where(Peer.peer_id == joined.body["peer_id"])).one()
    spill = ReportSpill(tmp_path / "spill")
    t = now_ms()
    spill.append([PendingReport(run["id"], pk, t + i, 0, i, 1.0, None, None) for i in range(3)])
    (name,) = spill.segments()
    spill.close()  # the worker is gone; its segment is an orphan
    with app.state.session_factory() as session, session.begin():
        session.add(SpilledSegment(name=name, lines_done=2))
    buffer = ReportBuffer(
        app.state.session_factory,
        flush_interval_s=3600,
        max_pending=100,
        snapshot_interval_s=5,
        online_ttl_s=60,
        spill=ReportSpill(tmp_path / "spill"),
    )
    assert await buffer.flush() == 1
    assert stored(app) == 1 and spilled_lines(tmp_path / "spill") == 0
    await buffer.close()
