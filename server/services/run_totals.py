"""A run's totals from its peers' latest reports: the figures its dashboard, its progress
snapshots and the metrics show.

:func:`run_totals` reads them with index-bounded queries (never the raw reports); the samples/s
is counted from the growth of the run's samples counter (:func:`counted_rate`), never the sum
of what peers claim. Sums are taken in double precision (:func:`float_sum`) and read back
saturated at ``MAX_INT`` (:func:`saturated`), so that none can overflow.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import SupportsFloat

from sqlalchemy import ColumnElement, Connection, Float, SQLColumnExpression, case, func, select
from sqlalchemy import cast as sa_cast
from sqlalchemy.orm import InstrumentedAttribute, Session

from peer.formats.rates import RATE_WINDOW_S, rate_between
from server.models import EpochSummary, Peer, ProgressSnapshot
from server.schemas import MAX_INT
from server.services import presence


def saturated(value: object) -> int:
    """A summed counter read back from SQL (an integer, a float, a decimal, or None) as an
    int within ``[0, MAX_INT]``."""
    if value is None:
        return 0
    if not isinstance(value, SupportsFloat | str):
        raise TypeError(f"not a number: {value!r}")
    number = float(value)
    if not math.isfinite(number):
        return MAX_INT if number > 0 else 0
    return max(0, min(MAX_INT, int(value if isinstance(value, int) else number)))


def float_sum(expression: SQLColumnExpression[float | None]) -> ColumnElement[float]:
    """SUM in double precision: it cannot overflow (SQLite's integer ``sum()`` raises past
    2^63, an error that would be taken for the database being unavailable). Read it back
    with :func:`saturated`; below 2^53 the sum of integers is exact."""
    return func.sum(sa_cast(expression, Float))


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


# The run's samples/s is its samples counter's growth over at least this long, nor over less
# than the minimum span (before the run has snapshots that old, its rate is 0): the rule a
# volunteer's line counts by too (peer.formats.rates).
RATE_WINDOW_MS = int(RATE_WINDOW_S * 1000)
# Two report intervals of a volunteer (the default report_interval_s told at join).
QUIET_MS = 20_000


def counted_rate(samples: int, now: int, reference: tuple[int, int] | None) -> float:
    """Samples per second from ``reference`` (when, samples then) to ``(now, samples)``:
    what the counters grew by over the coordinator's clock, never what anyone claims."""
    if reference is None:
        return 0.0
    taken_ms, before = reference
    rate = rate_between((taken_ms / 1000, before), (now / 1000, samples))
    return 0.0 if rate is None else rate


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
