"""Writing progress reports: the SQL of one batch, and the run's progress snapshots.

The report route admits a report (:mod:`server.services.report_guard`) and queues it in
the worker's :class:`~server.services.report_buffer.ReportBuffer`, which writes batches
with :func:`write_rows` (one transaction per batch, not per report) and then
:func:`take_snapshot_if_due`.

Concurrent batches from several workers compose: reports are plain inserts, a peer's latest
state and held-out metric only move forward in time, epoch summaries are additive upserts,
and a snapshot is claimed by a conditional update of ``runs.last_snapshot_ms``.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from itertools import pairwise
from typing import TypedDict, TypeVar

from sqlalchemy import (
    BigInteger,
    ColumnElement,
    Connection,
    Float,
    bindparam,
    case,
    func,
    insert,
    update,
)
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.orm import Session

from server.clock import now_ms
from server.models import EpochSummary, Peer, ProgressReport, ProgressSnapshot, Run, table_of
from server.schemas import MAX_INT, ReportCreate
from server.services.run_totals import run_totals

logger = logging.getLogger(__name__)

T = TypeVar("T")


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
    rate_cap: float | None = None,
) -> PendingReport:
    """A validated report body, stamped ``reported_ms`` (default now): what is queued, its
    claimed samples/s clamped to ``rate_cap`` (the most its peer is credited for)."""
    return PendingReport(
        run_id=run_id,
        peer_pk=peer_pk,
        reported_ms=now_ms() if reported_ms is None else reported_ms,
        epoch=body.epoch,
        samples=body.samples,
        samples_per_second=(
            body.samples_per_second if rate_cap is None else min(body.samples_per_second, rate_cap)
        ),
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
                # the counter as credited (the peers' rows hold the same)
                "samples": r.samples if r.samples_cap is None else min(r.samples, r.samples_cap),
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


def _latest(values: Iterable[T | None]) -> T | None:
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
    table = table_of(Peer)
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
    table = table_of(Peer)
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
    table = table_of(Peer)
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


class _EpochRow(TypedDict):
    """One run's epoch as a batch of reports sums it, upserted into ``epoch_summaries``."""

    run_id: str
    epoch: int
    first_report_ms: int
    last_report_ms: int
    reports: int
    loss_sum: float
    loss_count: int
    max_group_size: int | None
    rounds_done: int
    rounds_failed: int


def _upsert_epoch_summaries(connection: Connection, reports: Sequence[PendingReport]) -> None:
    rows: dict[tuple[str, int], _EpochRow] = {}
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
        row["first_report_ms"] = min(row["first_report_ms"], r.reported_ms)
        row["last_report_ms"] = max(row["last_report_ms"], r.reported_ms)
        row["reports"] += 1
        row["rounds_done"] += r.rounds_done
        row["rounds_failed"] += r.rounds_failed
        if r.loss is not None:
            row["loss_sum"] += r.loss
            row["loss_count"] += 1
        if r.group_size is not None:
            known = row["max_group_size"]
            row["max_group_size"] = r.group_size if known is None else max(known, r.group_size)
    table = table_of(EpochSummary)
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
        row["rounds_done"] = min(MAX_INT, row["rounds_done"])
        row["rounds_failed"] = min(MAX_INT, row["rounds_failed"])
        connection.execute(statement, row)


def _saturating_sum(stored: ColumnElement[int], added: ColumnElement[int]) -> ColumnElement[int]:
    """``stored + added``, but never past :data:`MAX_INT` (``added`` is at most that): the
    comparison cannot overflow where the sum could, on any backend."""
    return case((stored > MAX_INT - added, MAX_INT), else_=stored + added)


def take_snapshot_if_due(
    connection: Connection, run_id: str, interval_s: float, online_ttl_s: float
) -> bool:
    """Record the run's totals if the last snapshot is older than ``interval_s``.

    The conditional UPDATE claims the slot: of several workers flushing at once, exactly one
    sees a row updated and writes the snapshot.
    """
    now = now_ms()
    runs = table_of(Run)
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
