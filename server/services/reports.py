"""Ingesting progress reports in batches.

Why a buffer: one transaction per report caps SQLite at a few hundred reports per second
(every commit is a WAL append and a lock hand-over); one transaction per batch of hundreds
costs about the same as one report. So the report route validates the caller and the body,
appends to a :class:`ReportBuffer` and answers 202; the buffer writes everything it holds
every ``report_flush_interval_s`` (or sooner when ``report_buffer_max`` reports wait).

Why this is safe with several workers: each worker process has its own buffer and writes
through its own transaction; nothing is shared between them but the database. Every
statement of a batch is written so that concurrent batches from other workers compose:
reports are plain inserts, a peer's latest state only moves forward in time
(``last_report_ms <= :t``, and likewise its latest held-out metric, ``eval_metric_ms <= :t``),
epoch summaries (with the averaging rounds done and failed) are upserts with additive updates,
and a progress snapshot is claimed by a conditional update of ``runs.last_snapshot_ms``.

What can be lost: on a clean shutdown (SIGTERM/SIGINT, uvicorn's lifespan shutdown) the
buffer is flushed before the process exits, so no acknowledged report is lost; if the process
is killed outright, at most the last ``report_flush_interval_s`` of acknowledged reports are.
Set ``report_flush_interval_s=0`` to write each report before answering instead.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import cast

from sqlalchemy import BigInteger, Connection, Table, bindparam, case, func, insert, select, update
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.orm import Session, sessionmaker

from server.clock import now_ms
from server.models import EpochSummary, Peer, ProgressReport, ProgressSnapshot, Run
from server.schemas import ReportCreate

logger = logging.getLogger(__name__)

_MAX_FLUSH_ATTEMPTS = 5


@dataclass(frozen=True, slots=True)
class PendingReport:
    run_id: str
    peer_pk: int
    reported_ms: int
    epoch: int
    samples: int
    samples_per_second: float
    loss: float | None
    group_size: int | None
    rounds_done: int = 0
    rounds_failed: int = 0
    failure: str | None = None
    eval_metric: float | None = None
    loss_nan: bool = False


def pending_report(run_id: str, peer_pk: int, body: ReportCreate) -> PendingReport:
    """A validated report body, stamped now: what the route and the fast path queue."""
    return PendingReport(
        run_id=run_id,
        peer_pk=peer_pk,
        reported_ms=now_ms(),
        epoch=body.epoch,
        samples=body.samples,
        samples_per_second=body.samples_per_second,
        loss=body.loss,
        loss_nan=body.loss_nan,
        group_size=body.group_size,
        rounds_done=body.rounds_done,
        rounds_failed=body.rounds_failed,
        failure=body.failure,
        eval_metric=body.eval_metric,
    )


def write_reports(
    session: Session,
    reports: Sequence[PendingReport],
    *,
    snapshot_interval_s: float,
    online_ttl_s: float,
) -> None:
    """Write one batch in the session's transaction (the caller commits)."""
    if not reports:
        return
    connection = session.connection()
    connection.execute(
        insert(ProgressReport),
        [
            {
                "run_id": r.run_id,
                "peer_id": r.peer_pk,
                "reported_ms": r.reported_ms,
                "epoch": r.epoch,
                "samples": r.samples,
                "samples_per_second": r.samples_per_second,
                "loss": r.loss,
                "group_size": r.group_size,
                "rounds_done": r.rounds_done,
                "rounds_failed": r.rounds_failed,
                "failure": r.failure,
                "eval_metric": r.eval_metric,
            }
            for r in reports
        ],
    )
    _update_peers(connection, reports, online_ttl_s)
    _update_eval_metrics(connection, reports)
    _upsert_epoch_summaries(connection, reports)
    for run_id in sorted({r.run_id for r in reports}):
        take_snapshot_if_due(connection, run_id, snapshot_interval_s, online_ttl_s)


def _update_peers(
    connection: Connection, reports: Sequence[PendingReport], online_ttl_s: float
) -> None:
    latest: dict[int, PendingReport] = {}
    for r in reports:
        known = latest.get(r.peer_pk)
        if known is None or known.reported_ms <= r.reported_ms:
            latest[r.peer_pk] = r
    table = cast(Table, Peer.__table__)
    t = bindparam("b_t", type_=BigInteger())
    samples = bindparam("b_samples", type_=BigInteger())
    # A report after a silence longer than the online TTL closes the peer's session (its
    # length joins online_ms) and opens a new one. SET expressions read the old row.
    gap = table.c.last_seen_ms < t - int(online_ttl_s * 1000)
    statement = (
        update(table)
        .where(
            table.c.id == bindparam("b_id"),
            (table.c.last_report_ms.is_(None)) | (table.c.last_report_ms <= t),
        )
        .values(
            online_ms=case(
                (
                    gap & table.c.session_started_ms.is_not(None),
                    table.c.online_ms + table.c.last_seen_ms - table.c.session_started_ms,
                ),
                else_=table.c.online_ms,
            ),
            session_started_ms=case(
                (gap | table.c.session_started_ms.is_(None), t),
                else_=table.c.session_started_ms,
            ),
            last_report_ms=t,
            last_seen_ms=case((table.c.last_seen_ms < t, t), else_=table.c.last_seen_ms),
            epoch=bindparam("b_epoch"),
            # A counter that went backwards means the peer restarted from zero: bank what
            # it had counted so the run's total never shrinks.
            samples_base=case(
                (samples < table.c.samples, table.c.samples_base + table.c.samples),
                else_=table.c.samples_base,
            ),
            samples=samples,
            samples_per_second=bindparam("b_sps"),
            loss=bindparam("b_loss"),
            loss_nan=bindparam("b_loss_nan"),
            group_size=bindparam("b_group"),
        )
    )
    connection.execute(
        statement,
        [
            {
                "b_id": r.peer_pk,
                "b_t": r.reported_ms,
                "b_epoch": r.epoch,
                "b_samples": r.samples,
                "b_sps": r.samples_per_second,
                "b_loss": r.loss,
                "b_loss_nan": r.loss_nan,
                "b_group": r.group_size,
            }
            for r in sorted(latest.values(), key=lambda r: r.peer_pk)
        ],
    )


def _update_eval_metrics(connection: Connection, reports: Sequence[PendingReport]) -> None:
    """Each peer's latest held-out metric. Apart from :func:`_update_peers` because most
    reports carry none, and one without must not hide an older one that has."""
    latest: dict[int, PendingReport] = {}
    for r in reports:
        if r.eval_metric is None:
            continue
        known = latest.get(r.peer_pk)
        if known is None or known.reported_ms <= r.reported_ms:
            latest[r.peer_pk] = r
    if not latest:
        return
    table = cast(Table, Peer.__table__)
    t = bindparam("b_t", type_=BigInteger())
    connection.execute(
        update(table)
        .where(
            table.c.id == bindparam("b_id"),
            (table.c.eval_metric_ms.is_(None)) | (table.c.eval_metric_ms <= t),
        )
        .values(eval_metric=bindparam("b_metric"), eval_metric_ms=t),
        [
            {"b_id": r.peer_pk, "b_t": r.reported_ms, "b_metric": r.eval_metric}
            for r in sorted(latest.values(), key=lambda r: r.peer_pk)
        ],
    )


def _upsert_epoch_summaries(connection: Connection, reports: Sequence[PendingReport]) -> None:
    rows: dict[tuple[str, int], dict[str, object]] = {}
    for r in reports:
        row = rows.setdefault(
            (r.run_id, r.epoch),
            {
                "run_id": r.run_id,
                "epoch": r.epoch,
                "first_report_ms": r.reported_ms,
                "last_report_ms": r.reported_ms,
                "reports": 0,
                "loss_sum": 0.0,
                "loss_count": 0,
                "max_group_size": None,
                "rounds_done": 0,
                "rounds_failed": 0,
            },
        )
        row["first_report_ms"] = min(row["first_report_ms"], r.reported_ms)  # type: ignore[call-overload]
        row["last_report_ms"] = max(row["last_report_ms"], r.reported_ms)  # type: ignore[call-overload]
        row["reports"] += 1  # type: ignore[operator]
        row["rounds_done"] += r.rounds_done  # type: ignore[operator]
        row["rounds_failed"] += r.rounds_failed  # type: ignore[operator]
        if r.loss is not None:
            row["loss_sum"] += r.loss  # type: ignore[operator]
            row["loss_count"] += 1  # type: ignore[operator]
        if r.group_size is not None:
            known = row["max_group_size"]
            row["max_group_size"] = r.group_size if known is None else max(known, r.group_size)  # type: ignore[call-overload]
    table = cast(Table, EpochSummary.__table__)
    dialect = postgresql if connection.dialect.name == "postgresql" else sqlite
    statement = dialect.insert(table)
    new = statement.excluded
    statement = statement.on_conflict_do_update(
        index_elements=[table.c.run_id, table.c.epoch],
        set_={
            "first_report_ms": case(
                (new.first_report_ms < table.c.first_report_ms, new.first_report_ms),
                else_=table.c.first_report_ms,
            ),
            "last_report_ms": case(
                (new.last_report_ms > table.c.last_report_ms, new.last_report_ms),
                else_=table.c.last_report_ms,
            ),
            "reports": table.c.reports + new.reports,
            "loss_sum": table.c.loss_sum + new.loss_sum,
            "loss_count": table.c.loss_count + new.loss_count,
            "rounds_done": table.c.rounds_done + new.rounds_done,
            "rounds_failed": table.c.rounds_failed + new.rounds_failed,
            "max_group_size": case(
                (table.c.max_group_size.is_(None), new.max_group_size),
                (new.max_group_size > table.c.max_group_size, new.max_group_size),
                else_=table.c.max_group_size,
            ),
        },
    )
    # Sorted, so that two workers upserting the same rows lock them in the same order.
    for key in sorted(rows):
        connection.execute(statement, rows[key])


def take_snapshot_if_due(
    connection: Connection, run_id: str, interval_s: float, online_ttl_s: float
) -> bool:
    """Record the run's totals if the last snapshot is older than ``interval_s``.

    The conditional UPDATE claims the slot: of several workers flushing at once, exactly one
    sees a row updated and writes the snapshot.
    """
    now = now_ms()
    runs = cast(Table, Run.__table__)
    claimed = connection.execute(
        update(runs)
        .where(runs.c.id == run_id, runs.c.last_snapshot_ms <= now - int(interval_s * 1000))
        .values(last_snapshot_ms=now)
    )
    if claimed.rowcount != 1:
        return False
    totals = run_totals(connection, run_id, now, online_ttl_s)
    connection.execute(
        insert(ProgressSnapshot).values(
            run_id=run_id,
            taken_ms=now,
            epoch=totals.epoch,
            samples=totals.samples,
            samples_per_second=totals.samples_per_second,
            loss=totals.loss,
            peers_online=totals.peers_online,
            eval_metric=totals.eval_metric,
            mean_group_size=totals.mean_group_size,
            rounds_done=totals.rounds_done,
            rounds_failed=totals.rounds_failed,
        )
    )
    return True


@dataclass(frozen=True, slots=True)
class RunTotals:
    epoch: int
    samples: int
    samples_per_second: float
    loss: float | None
    peers_online: int
    mean_group_size: float | None = None
    eval_metric: float | None = None
    rounds_done: int = 0
    rounds_failed: int = 0


def run_totals(
    connection: Connection | Session, run_id: str, now: int, online_ttl_s: float
) -> RunTotals:
    """The run's state from its peers' latest reports: the highest epoch, all samples ever
    processed, and throughput, mean loss, mean group size and count of the peers seen within
    the TTL; the newest held-out metric; the averaging rounds done and failed so far.

    Three index-bounded queries: over the run's peers, its epoch summaries and one peer row;
    none reads raw reports."""
    online = Peer.last_seen_ms >= now - int(online_ttl_s * 1000)
    row = connection.execute(
        select(
            func.coalesce(func.max(Peer.epoch), 0),
            func.coalesce(func.sum(Peer.samples_base + Peer.samples), 0),
            func.coalesce(func.sum(case((online, Peer.samples_per_second), else_=0.0)), 0.0),
            func.avg(case((online, Peer.loss), else_=None)),
            func.coalesce(func.sum(case((online, 1), else_=0)), 0),
            func.avg(case((online, Peer.group_size), else_=None)),
        ).where(Peer.run_id == run_id)
    ).one()
    rounds_done, rounds_failed = connection.execute(
        select(
            func.coalesce(func.sum(EpochSummary.rounds_done), 0),
            func.coalesce(func.sum(EpochSummary.rounds_failed), 0),
        ).where(EpochSummary.run_id == run_id)
    ).one()
    eval_metric = connection.execute(
        select(Peer.eval_metric)
        .where(Peer.run_id == run_id, Peer.eval_metric_ms.is_not(None))
        .order_by(Peer.eval_metric_ms.desc(), Peer.id.desc())
        .limit(1)
    ).scalar()
    return RunTotals(
        epoch=int(row[0]),
        samples=int(row[1]),
        samples_per_second=float(row[2]),
        loss=None if row[3] is None else float(row[3]),
        peers_online=int(row[4]),
        mean_group_size=None if row[5] is None else float(row[5]),
        eval_metric=None if eval_metric is None else float(eval_metric),
        rounds_done=int(rounds_done),
        rounds_failed=int(rounds_failed),
    )


class ReportBuffer:
    """Reports acknowledged but not yet written, for one worker process.

    Use as an async context manager (the app's lifespan does): entering starts the flusher
    task, leaving stops it and writes whatever is still waiting.
    """

    def __init__(
        self,
        session_factory: sessionmaker[Session],
        *,
        flush_interval_s: float,
        max_pending: int,
        snapshot_interval_s: float,
        online_ttl_s: float,
        on_written: Callable[[int], None] = lambda n: None,
    ) -> None:
        self._session_factory = session_factory
        self._interval = flush_interval_s
        self._max_pending = max_pending
        self._snapshot_interval_s = snapshot_interval_s
        self._online_ttl_s = online_ttl_s
        self._on_written = on_written
        self._pending: list[PendingReport] = []
        self._wake = asyncio.Event()
        self._room = asyncio.Condition()
        self._task: asyncio.Task[None] | None = None
        self._closing = False
        self._lock = asyncio.Lock()

    @property
    def pending(self) -> int:
        return len(self._pending)

    async def __aenter__(self) -> ReportBuffer:
        if self._interval > 0:
            self._task = asyncio.create_task(self._run(), name="report-buffer-flusher")
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    async def add(self, report: PendingReport) -> None:
        """Queue a report. Waits (back-pressure) while the buffer is over twice its limit,
        which only happens when the database falls behind."""
        if self._closing:
            raise RuntimeError("the report buffer is closed")
        if self._interval == 0:
            await asyncio.to_thread(self._write, [report])
            self._on_written(1)
            return
        async with self._room:
            await self._room.wait_for(lambda: len(self._pending) < 2 * self._max_pending)
        self._pending.append(report)
        if len(self._pending) >= self._max_pending:
            self._wake.set()

    async def flush(self) -> int:
        """Write everything waiting now; returns how many reports were written."""
        async with self._lock:
            batch, self._pending = self._pending, []
            if not batch:
                return 0
            async with self._room:
                self._room.notify_all()
            for attempt in range(1, _MAX_FLUSH_ATTEMPTS + 1):
                try:
                    await asyncio.to_thread(self._write, batch)
                except Exception:
                    if attempt == _MAX_FLUSH_ATTEMPTS:
                        logger.exception(
                            "dropping %d progress reports after %d attempts", len(batch), attempt
                        )
                        return 0
                    logger.warning(
                        "writing %d progress reports failed; retrying", len(batch), exc_info=True
                    )
                    await asyncio.sleep(min(0.1 * 2**attempt, 2.0))
                else:
                    self._on_written(len(batch))
                    return len(batch)
        return 0  # pragma: no cover - the loop always returns

    def _write(self, batch: list[PendingReport]) -> None:
        with self._session_factory() as session, session.begin():
            write_reports(
                session,
                batch,
                snapshot_interval_s=self._snapshot_interval_s,
                online_ttl_s=self._online_ttl_s,
            )

    async def _run(self) -> None:
        while not self._closing:
            try:
                await asyncio.wait_for(self._wake.wait(), timeout=self._interval)
            except TimeoutError:
                pass
            self._wake.clear()
            await self.flush()

    async def close(self) -> None:
        """Stop the flusher and write what is left. Idempotent.

        The flusher is asked to stop rather than cancelled, so a batch being written (or
        retried) is never abandoned half-way.
        """
        self._closing = True
        self._wake.set()
        if self._task is not None:
            await self._task
            self._task = None
        await self.flush()
