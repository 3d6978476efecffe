"""Writing progress reports: the SQL of one batch, and the run totals read back from it.

Why batches: one transaction per report caps SQLite at a few hundred reports per second
(every commit is a WAL append and a lock hand-over); one transaction per batch of hundreds
costs about the same as one report. The report route admits a report
(:mod:`server.services.report_guard`), queues it in the worker's
:class:`~server.services.report_buffer.ReportBuffer` and answers 202; the buffer writes
batches with :func:`write_rows` and then :func:`take_snapshot_if_due`.

Why this is safe with several workers: each worker process has its own buffer and writes
through its own transaction; nothing is shared between them but the database. Every
statement of a batch is written so that concurrent batches from other workers compose:
reports are plain inserts, a peer's latest state only moves forward in time
(``last_report_ms <= :t``, and likewise its latest held-out metric, ``eval_metric_ms <= :t``),
epoch summaries (with the averaging rounds done and failed) are upserts with additive updates,
and a progress snapshot is claimed by a conditional update of ``runs.last_snapshot_ms``.
"""

from __future__ import annotations

import logging
import math
import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from itertools import pairwise
from typing import Any, cast

from sqlalchemy import (
    BigInteger,
    ColumnElement,
    Connection,
    Float,
    Table,
    bindparam,
    case,
    func,
    insert,
    select,
    update,
)
from sqlalchemy import cast as sa_cast
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.orm import InstrumentedAttribute, Session

from server.clock import now_ms
from server.models import EpochSummary, Peer, ProgressReport, ProgressSnapshot, Run
from server.schemas import MAX_INT, ReportCreate
from server.services import presence

logger = logging.getLogger(__name__)


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
    bytes_sent: int | None = None
    compute_utilisation: float | None = None
    # The most the peer may have contributed in all (banked resets plus this counter) when
    # the report was admitted; the write clamps the banked part to it. None: MAX_INT.
    samples_cap: int | None = None


def pending_report(
    run_id: str,
    peer_pk: int,
    body: ReportCreate,
    *,
    reported_ms: int | None = None,
    samples_cap: int | None = None,
) -> PendingReport:
    """A validated report body, stamped ``reported_ms`` (default now): what is queued."""
    return PendingReport(
        run_id=run_id,
        peer_pk=peer_pk,
        reported_ms=now_ms() if reported_ms is None else reported_ms,
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
        bytes_sent=body.bytes_sent,
        compute_utilisation=body.compute_utilisation,
        samples_cap=samples_cap,
    )


def write_reports(
    session: Session,
    reports: Sequence[PendingReport],
    *,
    snapshot_interval_s: float,
    online_ttl_s: float,
) -> None:
    """Write one batch and take the snapshots due, in the session's transaction (the caller
    commits)."""
    if not reports:
        return
    connection = session.connection()
    write_rows(connection, reports, online_ttl_s=online_ttl_s)
    for run_id in sorted({r.run_id for r in reports}):
        take_snapshot_if_due(connection, run_id, snapshot_interval_s, online_ttl_s)


def write_rows(
    connection: Connection, reports: Sequence[PendingReport], *, online_ttl_s: float
) -> None:
    """The rows of one batch: raw reports, peers' latest state, epoch summaries."""
    if not reports:
        return
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


def _latest(values: Iterable[Any]) -> Any:
    """The last of ``values`` that is not None (None if all are)."""
    found = None
    for value in values:
        if value is not None:
            found = value
    return found


def write_refusals(connection: Connection, refusals: Mapping[int, tuple[int, str, int]]) -> None:
    """Count refused reports per peer: ``{peer_pk: (how many, last bound, when)}``."""
    if not refusals:
        return
    table = cast(Table, Peer.__table__)
    connection.execute(
        update(table)
        .where(table.c.id == bindparam("b_id"))
        .values(
            reports_refused=table.c.reports_refused + bindparam("b_n", type_=BigInteger()),
            last_refusal=bindparam("b_bound"),
            last_refusal_ms=bindparam("b_t", type_=BigInteger()),
        ),
        [
            {"b_id": pk, "b_n": n, "b_bound": b, "b_t": t}
            for pk, (n, b, t) in sorted(refusals.items())
        ],
    )


def _update_peers(
    connection: Connection, reports: Sequence[PendingReport], online_ttl_s: float
) -> None:
    by_peer: dict[int, list[PendingReport]] = {}
    for r in reports:
        by_peer.setdefault(r.peer_pk, []).append(r)
    table = cast(Table, Peer.__table__)
    t = bindparam("b_t", type_=BigInteger())
    samples = bindparam("b_samples", type_=BigInteger())
    first = bindparam("b_first", type_=BigInteger())
    # A counter that went backwards means the peer restarted from zero: bank what it had
    # counted so the run's total never shrinks — against the stored counter for the batch's
    # first report, in Python between the batch's own — but never past the peer's cap (the
    # counter itself neither: admitted reports are within it, but several workers may each
    # have admitted a reset the others did not see).
    banked = (
        table.c.samples_base
        + case((first < table.c.samples, table.c.samples), else_=0)
        + bindparam("b_banked", type_=BigInteger())
    )
    room = bindparam("b_room", type_=BigInteger())
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
            samples_base=case((banked > room, room), else_=banked),
            samples=samples,
            samples_per_second=bindparam("b_sps"),
            loss=bindparam("b_loss"),
            loss_nan=bindparam("b_loss_nan"),
            group_size=bindparam("b_group"),
            # a report without them keeps the peer's last claims
            bytes_sent=func.coalesce(bindparam("b_bytes", type_=BigInteger()), table.c.bytes_sent),
            compute_utilisation=func.coalesce(
                bindparam("b_utilisation", type_=Float()), table.c.compute_utilisation
            ),
        )
    )
    rows = []
    for peer_pk in sorted(by_peer):
        ordered = sorted(by_peer[peer_pk], key=lambda r: r.reported_ms)
        r = ordered[-1]
        cap = MAX_INT if r.samples_cap is None else r.samples_cap
        counter = min(r.samples, cap)
        rows.append(
            {
                "b_id": peer_pk,
                "b_t": r.reported_ms,
                "b_epoch": r.epoch,
                "b_samples": counter,
                "b_first": ordered[0].samples,
                "b_banked": sum(a.samples for a, b in pairwise(ordered) if b.samples < a.samples),
                "b_room": cap - counter,
                "b_sps": r.samples_per_second,
                "b_loss": r.loss,
                "b_loss_nan": r.loss_nan,
                "b_group": r.group_size,
                # the batch's latest claims (a later report without them keeps them)
                "b_bytes": _latest(a.bytes_sent for a in ordered),
                "b_utilisation": _latest(a.compute_utilisation for a in ordered),
            }
        )
    connection.execute(statement, rows)


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
            "rounds_done": _saturating_sum(table.c.rounds_done, new.rounds_done),
            "rounds_failed": _saturating_sum(table.c.rounds_failed, new.rounds_failed),
            "max_group_size": case(
                (table.c.max_group_size.is_(None), new.max_group_size),
                (new.max_group_size > table.c.max_group_size, new.max_group_size),
                else_=table.c.max_group_size,
            ),
        },
    )
    # Sorted, so that two workers upserting the same rows lock them in the same order.
    for key in sorted(rows):
        row = rows[key]
        for name in ("rounds_done", "rounds_failed"):
            row[name] = min(MAX_INT, cast(int, row[name]))
        connection.execute(statement, row)


def _saturating_sum(stored: ColumnElement[int], added: ColumnElement[int]) -> ColumnElement[int]:
    """``stored + added``, but never past :data:`MAX_INT` (``added`` is at most that): the
    comparison cannot overflow where the sum could, on any backend."""
    return case((stored > MAX_INT - added, MAX_INT), else_=stored + added)


def saturated(value: object) -> int:
    """A summed counter read back from SQL (an integer, a float, a decimal, or None) as an
    int within ``[0, MAX_INT]``."""
    if value is None:
        return 0
    number = float(cast(float, value))
    if not math.isfinite(number):
        return MAX_INT if number > 0 else 0
    return max(0, min(MAX_INT, int(value if isinstance(value, int) else number)))


def float_sum(expression: ColumnElement[Any] | InstrumentedAttribute[Any]) -> ColumnElement[float]:
    """SUM in double precision: it cannot overflow (SQLite's integer ``sum()`` raises past
    2^63, an error that would be taken for the database being unavailable). Read it back
    with :func:`saturated`; below 2^53 the sum of integers is exact."""
    return func.sum(sa_cast(expression, Float))


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
    # What the online peers say they compute, summed: their claim, shown beside the rate
    # the coordinator counts (``samples_per_second``), never instead of it.
    compute_samples_per_second: float = 0.0
    # Bytes the peers that report them say they sent, over the samples of those peers;
    # None before any peer reports its bytes.
    bytes_per_sample: float | None = None


# The run's samples/s is its samples counter's growth over at least this long.
RATE_WINDOW_MS = 10_000
# Nor over less than this: before the run has snapshots that old, its rate is 0.
MIN_RATE_SPAN_MS = 1_000
# Two report intervals of a volunteer (the default report_interval_s told at join).
QUIET_MS = 20_000


def counted_rate(samples: int, now: int, reference: tuple[int, int] | None) -> float:
    """Samples per second from ``reference`` (when, samples then) to ``(now, samples)``:
    what the counters grew by over the coordinator's clock, never what anyone claims."""
    if reference is None:
        return 0.0
    taken_ms, before = reference
    span_ms = now - taken_ms
    if span_ms < MIN_RATE_SPAN_MS:
        return 0.0
    return max(0, samples - before) * 1000 / span_ms


def _rate_reference(
    connection: Connection | Session, run_id: str, now: int
) -> tuple[int, int] | None:
    """The snapshot the run's rate is counted from: the newest at least
    :data:`RATE_WINDOW_MS` old, else the oldest (a young run)."""
    base = select(ProgressSnapshot.taken_ms, ProgressSnapshot.samples).where(
        ProgressSnapshot.run_id == run_id
    )
    row = connection.execute(
        base.where(ProgressSnapshot.taken_ms <= now - RATE_WINDOW_MS)
        .order_by(ProgressSnapshot.taken_ms.desc())
        .limit(1)
    ).first()
    if row is None:
        row = connection.execute(base.order_by(ProgressSnapshot.taken_ms).limit(1)).first()
    return None if row is None else (int(row[0]), int(row[1]))


def _sql_median(
    connection: Connection | Session,
    column: InstrumentedAttribute[float | None],
    n: int,
    *where: ColumnElement[bool],
) -> float | None:
    """The median of ``column`` over the ``n`` peers ``where`` holds (as
    :func:`statistics.median`; None when n is 0): sorted in SQL, the middle one or two rows
    read back, so that a run of 10,000 peers does not send them all to Python."""
    if n <= 0:
        return None
    middle = connection.scalars(
        select(column).where(*where).order_by(column).limit(2 - n % 2).offset((n - 1) // 2)
    ).all()
    return _median(middle)


def _median(values: Sequence[float | None]) -> float | None:
    found = [float(v) for v in values if v is not None]
    return statistics.median(found) if found else None


def run_totals(
    connection: Connection | Session, run_id: str, now: int, online_ttl_s: float
) -> RunTotals:
    """The run's state from its peers' latest reports: the highest epoch, all samples ever
    processed, the count of the peers seen within the TTL and their mean group size, the
    median of their losses and of their latest held-out metrics (the newest metric if none
    evaluated within the TTL), the averaging rounds done and failed so far.

    The samples/s is counted, not claimed: the growth of the run's samples counter since
    the newest progress snapshot at least :data:`RATE_WINDOW_MS` older than the newest
    report, on the coordinator's clock (0 with no peer online). What the peers claim to compute is summed apart.

    Medians, so that one peer's wild value (within the report bounds) moves no headline or
    chart; sums in double precision, saturated at MAX_INT, so that none can overflow.
    Index-bounded queries over the run's peers, its epoch summaries, one peer row and one
    or two snapshots; none reads raw reports."""
    since = now - int(online_ttl_s * 1000)
    online = presence.online(since)
    evaluated = Peer.eval_metric.is_not(None) & (Peer.eval_metric_ms >= since)
    row = connection.execute(
        select(
            func.coalesce(func.max(Peer.epoch), 0),
            float_sum(Peer.samples_base + Peer.samples),
            func.coalesce(func.sum(case((online, Peer.samples_per_second), else_=0.0)), 0.0),
            func.coalesce(func.sum(case((online, 1), else_=0)), 0),
            func.avg(case((online, Peer.group_size), else_=None)),
            func.max(Peer.last_report_ms),
            func.count(case((online & Peer.loss.is_not(None), 1))),
            func.count(case((online & evaluated, 1))),
        ).where(Peer.run_id == run_id)
    ).one()
    rounds_done, rounds_failed = connection.execute(
        select(float_sum(EpochSummary.rounds_done), float_sum(EpochSummary.rounds_failed)).where(
            EpochSummary.run_id == run_id
        )
    ).one()
    sent, sending_samples = connection.execute(
        select(float_sum(Peer.bytes_sent), float_sum(Peer.samples)).where(
            Peer.run_id == run_id, Peer.bytes_sent.is_not(None)
        )
    ).one()
    where = (Peer.run_id == run_id, online)
    loss = _sql_median(connection, Peer.loss, int(row[6]), *where, Peer.loss.is_not(None))
    eval_metric = _sql_median(connection, Peer.eval_metric, int(row[7]), *where, evaluated)
    if eval_metric is None:
        newest = connection.execute(
            select(Peer.eval_metric)
            .where(Peer.run_id == run_id, Peer.eval_metric_ms.is_not(None))
            .order_by(Peer.eval_metric_ms.desc(), Peer.id.desc())
            .limit(1)
        ).scalar()
        eval_metric = None if newest is None else float(newest)
    samples = saturated(row[1])
    peers_online = int(row[3])
    # Up to the newest report, not to now: the total stands still between two reports (10 s
    # apart for a volunteer), and a run of one or two volunteers would read up to half its
    # rate just before the next one lands. Not further back than QUIET_MS, though: reports
    # that stop make the rate fall.
    until = now if row[5] is None else min(now, max(int(row[5]), now - QUIET_MS))
    rate = (
        counted_rate(samples, until, _rate_reference(connection, run_id, until))
        if peers_online
        else 0.0
    )
    return RunTotals(
        epoch=int(row[0]),
        samples=samples,
        samples_per_second=rate,
        loss=loss,
        peers_online=peers_online,
        mean_group_size=None if row[4] is None else float(row[4]),
        eval_metric=eval_metric,
        rounds_done=saturated(rounds_done),
        rounds_failed=saturated(rounds_failed),
        compute_samples_per_second=float(row[2]),
        bytes_per_sample=float(sent) / float(sending_samples) if sending_samples else None,
    )
