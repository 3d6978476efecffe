"""Report retention: raw progress reports older than ``report_retention_s`` are folded into
per-bucket rollups (:mod:`server.services.rollups`) and deleted.

The newest reports with a group size (``RECENT_GROUP_SIZES``, ``RECENT_GROUP_REPORTS``) are
kept whatever their age, flagged ``rolled_up``; a volunteer's chart reads rollups and raw
rows together, so it is the same before and after the job. Nothing else reads raw reports.

:class:`ReportRetention` runs from every worker's report flusher; the worker that moves the
``housekeeping`` row's due time on (:func:`claim`, a conditional UPDATE) runs it, once per
``report_retention_interval_s``. It works oldest first in transactions of :data:`BATCH`
reports (fold, flag, delete) and stops after half the interval.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from sqlalchemy import delete, insert, or_, select, tuple_, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session, sessionmaker

from server.clock import now_ms
from server.models import Housekeeping, ProgressReport, ReportRollup
from server.services.dashboard import RECENT_GROUP_REPORTS
from server.services.progress import RECENT_GROUP_SIZES
from server.services.rollups import (
    Bucket,
    bucket_width_ms,
    from_row,
    horizon_ms,
    merge,
    summarize,
)

logger = logging.getLogger(__name__)

JOB = "report_retention"
BATCH = 1000
# How often a worker asks the database whether the job is due (at most).
POLL_MS = 60_000


def claim(session_factory: sessionmaker[Session], name: str, now: int, interval_ms: int) -> bool:
    """Whether this caller may run job ``name`` now; if so, the next run is due in
    ``interval_ms``. Of several callers racing, one wins: the UPDATE is conditional on the
    due time it moves (and the first INSERT on the primary key)."""
    try:
        with session_factory() as session, session.begin():
            moved = session.execute(
                update(Housekeeping)
                .where(Housekeeping.name == name, Housekeeping.due_ms <= now)
                .values(due_ms=now + interval_ms)
                .execution_options(synchronize_session=False)
            )
            # Session.execute is typed Result; an UPDATE's is a CursorResult, with rowcount.
            if moved.rowcount == 1:  # type: ignore[attr-defined]
                return True
            due = session.scalar(select(Housekeeping.due_ms).where(Housekeeping.name == name))
            if due is not None:
                return False
            session.execute(insert(Housekeeping).values(name=name, due_ms=now + interval_ms))
    except IntegrityError:  # another worker inserted the row first
        return False
    return True


@dataclass
class _Kept:
    """Which old reports of one run the recent group sizes still show."""

    floor: int | None  # reports from this id on are the newest RECENT_GROUP_REPORTS
    grouped: set[int] = field(default_factory=set)

    def __contains__(self, report_id: int) -> bool:
        return self.floor is None or report_id >= self.floor or report_id in self.grouped


def _kept(session: Session, run_id: str) -> _Kept:
    floor = session.scalar(
        select(ProgressReport.id)
        .where(ProgressReport.run_id == run_id)
        .order_by(ProgressReport.id.desc())
        .offset(RECENT_GROUP_REPORTS - 1)
        .limit(1)
    )
    grouped = session.scalars(
        select(ProgressReport.id)
        .where(ProgressReport.run_id == run_id, ProgressReport.group_size.is_not(None))
        .order_by(ProgressReport.id.desc())
        .limit(RECENT_GROUP_SIZES)
    )
    return _Kept(floor, set(grouped))


def _values(b: Bucket) -> dict[str, int]:
    return {
        "first_ms": b.first_ms,
        "last_ms": b.last_ms,
        "reports": b.reports,
        "first_samples": b.first_samples,
        "last_samples": b.last_samples,
        "banked": b.banked,
    }


def _fold(session: Session, buckets: Iterable[Bucket]) -> None:
    """Add ``buckets`` (of reports newer than any already folded) to the rollups."""
    new = {(b.peer_pk, b.bucket_ms): b for b in buckets}
    if not new:
        return
    existing = session.scalars(
        select(ReportRollup).where(
            tuple_(ReportRollup.peer_id, ReportRollup.bucket_ms).in_(list(new))
        )
    )
    for row in existing:
        merged = merge(from_row(row), new.pop((row.peer_id, row.bucket_ms)))
        for name, value in _values(merged).items():
            setattr(row, name, value)
    session.add_all(
        ReportRollup(peer_id=b.peer_pk, bucket_ms=b.bucket_ms, **_values(b)) for b in new.values()
    )
    session.flush()


class ReportRetention:
    """The retention job of one worker. :meth:`due` is a cheap local check the flusher
    makes on every tick; :meth:`run` (blocking: run it in a thread) claims the job and
    prunes."""

    def __init__(
        self,
        session_factory: sessionmaker[Session],
        *,
        retention_s: float,
        interval_s: float,
        online_ttl_s: float,
        clock: Callable[[], int] = now_ms,
        on_pruned: Callable[[int], None] = lambda n: None,
        batch: int = BATCH,
    ) -> None:
        self._session_factory = session_factory
        self._retention_s = retention_s
        self._interval_ms = int(interval_s * 1000)
        self._width_ms = bucket_width_ms(online_ttl_s)
        self._clock = clock
        self._on_pruned = on_pruned
        self._batch_size = batch
        self._next_check = 0

    def due(self) -> bool:
        return self._clock() >= self._next_check

    def run(self, stop: threading.Event | None = None) -> int:
        """Prune if this worker wins the job; returns how many reports it deleted."""
        now = self._clock()
        self._next_check = now + min(self._interval_ms, POLL_MS)
        try:
            if not claim(self._session_factory, JOB, now, self._interval_ms):
                return 0
            return self.prune(now, stop)
        except Exception as error:  # the next run tries again
            logger.warning("report retention failed: %s", error)
            return 0

    def prune(self, now: int, stop: threading.Event | None = None) -> int:
        """Fold and delete the reports past the retention horizon at ``now`` (whether or not
        this worker holds the job: callers claim first)."""
        cutoff = horizon_ms(now, self._retention_s, self._width_ms)
        assert cutoff is not None
        deadline = time.monotonic() + self._interval_ms / 2000
        kept: dict[str, _Kept] = {}
        after = (-1, -1)  # (reported_ms, id) of the last report seen
        pruned = 0
        while not (stop is not None and stop.is_set()) and time.monotonic() < deadline:
            with self._session_factory() as session, session.begin():
                last, gone = self._batch(session, cutoff, after, kept)
            if last is None:
                break
            after = last
            pruned += gone
            if gone:
                self._on_pruned(gone)
        return pruned

    def _batch(
        self, session: Session, cutoff: int, after: tuple[int, int], kept: dict[str, _Kept]
    ) -> tuple[tuple[int, int] | None, int]:
        """Fold, flag and delete the next batch of reports before ``cutoff`` in time order
        after ``after``; returns the last one's (reported_ms, id) (None: no more) and how
        many were deleted."""
        t, i = ProgressReport.reported_ms, ProgressReport.id
        columns = (ProgressReport.run_id, ProgressReport.peer_id, ProgressReport.samples)
        rows = session.execute(
            select(i, t, *columns, ProgressReport.rolled_up)
            .where(t < cutoff, t >= after[0], or_(t > after[0], i > after[1]))
            .order_by(t, i)
            .limit(self._batch_size)
        ).all()
        if not rows:
            return None, 0
        for run_id in {r.run_id for r in rows} - kept.keys():
            kept[run_id] = _kept(session, run_id)
        fresh = [r for r in rows if not r.rolled_up]
        folded = ((r.peer_id, r.reported_ms, r.samples) for r in fresh)
        _fold(session, summarize(folded, self._width_ms))
        gone = [r.id for r in rows if r.id not in kept[r.run_id]]
        flag = [r.id for r in fresh if r.id in kept[r.run_id]]
        if gone:
            session.execute(delete(ProgressReport).where(ProgressReport.id.in_(gone)))
        if flag:
            session.execute(
                update(ProgressReport)
                .where(ProgressReport.id.in_(flag))
                .values(rolled_up=True)
                .execution_options(synchronize_session=False)
            )
        return (rows[-1].reported_ms, rows[-1].id), len(gone)
