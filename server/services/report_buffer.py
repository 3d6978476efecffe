"""One worker's reports acknowledged but not yet written, and how they get written.

Every ``report_flush_interval_s`` (sooner when ``report_buffer_max`` reports wait) the
buffer writes what it holds in one transaction (:func:`~server.services.reports.write_rows`),
then takes the progress snapshots due, one transaction per run. A batch that cannot be
written goes to the spill (:mod:`server.services.report_spill`) when the database is
unavailable, replayed once it answers again; otherwise it is written row by row, and a row
that still fails is logged and dropped.

No acknowledged report is lost while the process lives, nor on a restart (a worker replays
every segment no live worker holds); a clean shutdown writes or spills what waits. The
flusher also starts housekeeping (:mod:`server.services.retention`) when due, in a thread
of its own.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Protocol

from sqlalchemy import Connection, exc, insert, select, update
from sqlalchemy.orm import Session, sessionmaker

from server.exceptions import Unavailable
from server.models import Peer, SpilledSegment, table_of
from server.services import runs as run_service
from server.services.report_spill import ReportSpill
from server.services.reports import (
    PendingReport,
    take_snapshot_if_due,
    write_refusals,
    write_rows,
)

logger = logging.getLogger(__name__)

MAX_BACKOFF_S = 5.0
# Spilled lines written per transaction on replay.
REPLAY_CHUNK = 500
# How often the flusher looks at the spill when reports are written before answering.
IDLE_TICK_S = 1.0

Refusals = dict[int, tuple[int, str, int]]


_ARITHMETIC = "integer overflow"


def database_unavailable(error: BaseException) -> bool:
    """Whether ``error`` says the database could not take a write at all (as opposed to
    refusing one statement's data)."""
    if isinstance(error, exc.DBAPIError):
        if _ARITHMETIC in str(error.orig).lower():
            # SQLite reports an overflowing sum as an OperationalError: the statement's own
            # data, not the database, so never a reason to answer 503 (or spill forever).
            return False
        return error.connection_invalidated or isinstance(
            error, exc.OperationalError | exc.InterfaceError
        )
    return isinstance(error, exc.TimeoutError)  # no connection free in the pool


class Housekeeping(Protocol):
    """A periodic job the flusher starts (one run at a time)."""

    def due(self) -> bool:
        """Cheap, local: whether to start :meth:`run` now."""
        ...

    def run(self, stop: threading.Event) -> object:
        """Blocking (runs in a thread); returns soon once ``stop`` is set."""
        ...


class _Unavailable(Exception):
    pass


class _AlreadyWritten(Exception):
    """Another worker wrote these spilled lines first."""


class ReportBuffer:
    """Reports acknowledged but not yet written, for one worker process.

    Use as an async context manager (the app's lifespan does): entering starts the flusher
    task, leaving stops it and writes (or spills) whatever is still waiting.
    """

    def __init__(
        self,
        session_factory: sessionmaker[Session],
        *,
        flush_interval_s: float,
        max_pending: int,
        snapshot_interval_s: float,
        online_ttl_s: float,
        spill: ReportSpill | None = None,
        on_written: Callable[[int], None] = lambda n: None,
        housekeeping: Housekeeping | None = None,
    ) -> None:
        self._session_factory = session_factory
        self._interval = flush_interval_s
        self._max_pending = max_pending
        self._snapshot_interval_s = snapshot_interval_s
        self._online_ttl_s = online_ttl_s
        self._spill = spill
        self._on_written = on_written
        self._pending: list[PendingReport] = []
        # Neither written nor spilled (the disk refused too): retried at every flush.
        self._held: list[PendingReport] = []
        self._refusals: Refusals = {}
        self._wake = asyncio.Event()
        self._room = asyncio.Condition()
        self._task: asyncio.Task[None] | None = None
        self._closing = False
        self._closed = False
        self._lock = asyncio.Lock()
        # The spill may hold segments (a previous process's) until a replay finds none.
        self._backlog = spill is not None
        self._failures = 0
        self._retry_at = 0.0
        self._spill_failing = False
        self._housekeeping = housekeeping
        self._housekeeping_task: asyncio.Task[object] | None = None
        self._stop = threading.Event()

    @property
    def pending(self) -> int:
        return len(self._pending) + len(self._held)

    async def __aenter__(self) -> ReportBuffer:
        self._task = asyncio.create_task(self._run(), name="report-buffer-flusher")
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    async def add(self, report: PendingReport) -> None:
        """Queue a report. Waits (back-pressure) while twice ``max_pending`` reports wait;
        :class:`~server.exceptions.Unavailable` (503) instead when some of them could be
        neither written nor spilled (they are kept in memory, and would only grow)."""
        if self._closing:
            raise RuntimeError("the report buffer is closed")
        if self._held and self.pending >= 2 * self._max_pending:
            raise Unavailable(
                "the coordinator can hold no more progress reports: neither its database "
                "nor its spill directory takes them; try again later",
                retry_after_s=MAX_BACKOFF_S,
            )
        if self._interval == 0:
            async with self._lock:
                self._held.append(report)
                await self._flush_locked()
            return
        async with self._room:
            await self._room.wait_for(lambda: self.pending < 2 * self._max_pending)
        self._pending.append(report)
        if len(self._pending) >= self._max_pending:
            self._wake.set()

    def count_refusal(self, peer_pk: int, bound: str, at_ms: int) -> None:
        """Count a refused report against its peer (written with the next flush)."""
        n = self._refusals.get(peer_pk, (0, "", 0))[0]
        self._refusals[peer_pk] = (n + 1, bound, at_ms)

    async def flush(self) -> int:
        """Write everything waiting now (spilling what the database cannot take); returns
        how many reports were written."""
        async with self._lock:
            return await self._flush_locked()

    async def _flush_locked(self) -> int:
        batch, self._held, self._pending = [*self._held, *self._pending], [], []
        refusals, self._refusals = self._refusals, {}
        async with self._room:
            self._room.notify_all()
        if not batch and not refusals and not (self._backlog and self._due()):
            return 0
        written, held, unwritten = await asyncio.to_thread(self._flush_sync, batch, refusals)
        self._held = held + self._held
        for pk, (n, bound, at) in unwritten.items():
            newer = self._refusals.get(pk)
            self._refusals[pk] = (n, bound, at) if newer is None else (n + newer[0], *newer[1:])
        if written:
            self._on_written(written)
        return written

    def _due(self) -> bool:
        return time.monotonic() >= self._retry_at

    def _flush_sync(
        self, batch: list[PendingReport], refusals: Refusals
    ) -> tuple[int, list[PendingReport], Refusals]:
        """In a thread: replay the spill, write the batch, count refusals. Returns how many
        reports were written, those neither written nor spilled, and the refusals not
        written."""
        written, rest = 0, batch
        if not self._due():  # backing off: straight to the spill
            return written, self._spill_or_hold(rest), refusals
        failed = unavailable = False
        try:
            written += self._replay()
        except _Unavailable:
            failed = unavailable = True
        except Exception:  # e.g. a segment that cannot be read: retried after a back-off
            logger.exception("cannot replay the spilled progress reports")
            failed = True
        if not unavailable:
            done, rest = self._write_batch(batch)
            written += done
        if failed or rest:  # back off before asking the database again
            self._failures += 1
            self._retry_at = time.monotonic() + min(0.1 * 2**self._failures, MAX_BACKOFF_S)
            return written, self._spill_or_hold(rest), refusals
        if self._failures:
            logger.warning("the database takes progress reports again")
        self._failures = 0
        try:
            with self._session_factory() as session, session.begin():
                write_refusals(session.connection(), refusals)
        except Exception as error:  # kept for the next flush
            logger.warning("cannot count refused reports: %s", error)
            return written, [], refusals
        return written, [], {}

    def _write_batch(self, batch: list[PendingReport]) -> tuple[int, list[PendingReport]]:
        """Write ``batch``, row by row if it fails as a whole; returns how many were written
        and those left when the database became unavailable."""
        if not batch:
            return 0, []
        try:
            self._transaction(batch)
        except Exception as error:
            if database_unavailable(error):
                self._note_unavailable(error, len(batch))
                return 0, batch
            logger.warning("a batch of %d reports failed (%s); writing them one by one",
                           len(batch), error)  # fmt: skip
        else:
            self._take_snapshots(batch)
            return len(batch), []
        written = 0
        for i, report in enumerate(batch):
            try:
                self._transaction([report])
            except Exception as error:
                if database_unavailable(error):
                    self._note_unavailable(error, len(batch) - i)
                    return written, batch[i:]
                self._drop(report, error)
            else:
                written += 1
        self._take_snapshots(batch)
        return written, []

    def _transaction(
        self, reports: Sequence[PendingReport], claim: tuple[str, int, int] | None = None
    ) -> None:
        """Write ``reports`` in one transaction; with ``claim`` (segment, first line, lines)
        also record those spilled lines as written, or raise :class:`_AlreadyWritten`."""
        with self._session_factory() as session, session.begin():
            connection = session.connection()
            if claim is not None:
                _claim(connection, *claim)
            write_rows(connection, reports, online_ttl_s=self._online_ttl_s)

    def _take_snapshots(self, reports: Sequence[PendingReport]) -> None:
        for run_id in sorted({r.run_id for r in reports}):
            try:
                with self._session_factory() as session, session.begin():
                    take_snapshot_if_due(
                        session.connection(), run_id, self._snapshot_interval_s,
                        self._online_ttl_s,
                    )  # fmt: skip
            except Exception as error:
                logger.warning("cannot take a progress snapshot of run %s: %s", run_id, error)
        self._advance_runs(reports)

    def _advance_runs(self, reports: Sequence[PendingReport]) -> None:
        """Start the runs waiting for volunteers that are now online, finish those at their
        last epoch (:func:`server.services.runs.after_reports`)."""
        epochs: dict[str, int] = {}
        for report in reports:
            epochs[report.run_id] = max(report.epoch, epochs.get(report.run_id, 0))
        try:
            with self._session_factory() as session, session.begin():
                run_service.after_reports(session, epochs, online_ttl_s=self._online_ttl_s)
        except Exception as error:  # the next batch checks again
            logger.warning("cannot start or finish runs after reports: %s", error)

    def _drop(self, report: PendingReport, error: BaseException) -> None:
        try:
            with self._session_factory() as session:
                peer = session.scalar(select(Peer.peer_id).where(Peer.id == report.peer_pk))
        except Exception:
            peer = None
        logger.error(
            "dropping a progress report of peer %s (row %d) of run %s that cannot be written: %s",
            peer,
            report.peer_pk,
            report.run_id,
            error,
        )

    def _note_unavailable(self, error: BaseException, n: int) -> None:
        if self._failures == 0:
            logger.error("the database cannot take %d progress reports: %s", n, error)

    def _spill_or_hold(self, reports: list[PendingReport]) -> list[PendingReport]:
        if self._spill is None:
            return reports
        try:
            self._spill.append(reports)
        except OSError as error:
            if not self._spill_failing:  # once per outage: this runs at every flush
                logger.error(
                    "cannot spill %d progress reports to %s (%s) while the database is "
                    "unavailable: keeping them in memory (up to %d, then reports are refused "
                    "with 503); they are lost if this coordinator stops before the database "
                    "or the spill directory takes them. Free space there, or set "
                    "SWARMGRAD_SPILL_DIR to another filesystem.",
                    len(reports), self._spill.directory, error, 2 * self._max_pending,
                )  # fmt: skip
            self._spill_failing = True
            return reports
        if self._spill_failing:
            logger.warning("the spill directory %s takes progress reports again",
                           self._spill.directory)  # fmt: skip
        self._spill_failing = False
        self._backlog = True
        return []

    def _replay(self) -> int:
        """Write every spilled line this worker can take; :class:`_Unavailable` when the
        database fails meanwhile (what is left stays spilled)."""
        if self._spill is None or not self._backlog:
            return 0
        written = 0
        for name in self._spill.segments():
            try:
                lines = self._spill.read(name)
            except FileNotFoundError:  # replayed and removed by another worker
                self._spill.remove(name)
                continue
            written += self._replay_segment(name, lines)
            self._spill.remove(name)
            self._forget(name)
        self._backlog = False
        return written

    def _replay_segment(self, name: str, lines: list[PendingReport | None]) -> int:
        written, done = 0, self._lines_done(name)
        while done < len(lines):
            chunk = lines[done : done + REPLAY_CHUNK]
            reports = [r for r in chunk if r is not None]
            try:
                self._transaction(reports, claim=(name, done, len(chunk)))
            except _AlreadyWritten:
                done = self._lines_done(name)
                continue
            except Exception as error:
                if database_unavailable(error):
                    self._note_unavailable(error, len(lines) - done)
                    raise _Unavailable from error
                # One line at a time: a bad one is dropped, its line still claimed.
                for report in chunk:
                    try:
                        self._transaction([] if report is None else [report], (name, done, 1))
                        written += report is not None
                    except _AlreadyWritten:
                        break
                    except Exception as line_error:
                        if database_unavailable(line_error):
                            raise _Unavailable from line_error
                        assert report is not None  # an empty write cannot fail on data
                        self._drop(report, line_error)
                        self._skip_line(name, done)
                    done += 1
                done = self._lines_done(name)
                continue
            written += len(reports)
            done += len(chunk)
            self._take_snapshots(reports)
        return written

    def _lines_done(self, name: str) -> int:
        try:
            with self._session_factory() as session, session.begin():
                done = session.scalar(
                    select(SpilledSegment.lines_done).where(SpilledSegment.name == name)
                )
                if done is None:
                    session.execute(insert(SpilledSegment).values(name=name, lines_done=0))
                    done = 0
        except exc.IntegrityError:  # another worker inserted it first
            return self._lines_done(name)
        except Exception as error:
            if database_unavailable(error):
                raise _Unavailable from error
            raise
        return int(done)

    def _skip_line(self, name: str, line: int) -> None:
        try:
            with self._session_factory() as session, session.begin():
                _claim(session.connection(), name, line, 1)
        except _AlreadyWritten:
            pass
        except Exception as error:
            if database_unavailable(error):
                raise _Unavailable from error
            raise

    def _forget(self, name: str) -> None:
        """Delete the record of a removed segment (best effort: a stale one is harmless)."""
        try:
            with self._session_factory() as session, session.begin():
                session.execute(
                    table_of(SpilledSegment).delete().where(SpilledSegment.name == name)
                )
        except Exception as error:
            logger.warning("cannot forget spill segment %s: %s", name, error)

    async def _run(self) -> None:
        tick = self._interval if self._interval > 0 else IDLE_TICK_S
        while not self._closing:
            try:
                await asyncio.wait_for(self._wake.wait(), timeout=tick)
            except TimeoutError:
                pass
            self._wake.clear()
            await self.flush()
            self._start_housekeeping()

    def _start_housekeeping(self) -> None:
        job = self._housekeeping
        running = self._housekeeping_task
        if job is None or (running is not None and not running.done()) or not job.due():
            return
        self._housekeeping_task = asyncio.create_task(
            asyncio.to_thread(job.run, self._stop), name="housekeeping"
        )

    async def close(self) -> None:
        """Stop the flusher and write (or spill) what is left. Idempotent.

        The flusher is asked to stop rather than cancelled, so a batch being written is never
        abandoned half-way.
        """
        if self._closed:
            return
        self._closing = True
        self._wake.set()
        if self._task is not None:
            await self._task
            self._task = None
        self._stop.set()
        if self._housekeeping_task is not None:
            await self._housekeeping_task
            self._housekeeping_task = None
        self._retry_at = 0.0  # one last try, whatever the back-off
        await self.flush()
        if self._held:
            logger.error("%d acknowledged progress reports could be neither written nor "
                         "spilled and are lost", len(self._held))  # fmt: skip
        if self._spill is not None:
            self._spill.close()
        self._closed = True


def _claim(connection: Connection, name: str, first: int, lines: int) -> None:
    table = table_of(SpilledSegment)
    claimed = connection.execute(
        update(table)
        .where(table.c.name == name, table.c.lines_done == first)
        .values(lines_done=first + lines)
    )
    if claimed.rowcount != 1:
        raise _AlreadyWritten
