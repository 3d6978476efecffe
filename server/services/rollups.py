"""A volunteer's contribution over time, from raw reports and from their rollups.

Raw progress reports are kept for ``report_retention_s``; older ones are folded into one
:class:`~server.models.ReportRollup` row per peer and time bucket
(:mod:`server.services.retention`). A bucket is as wide as the online TTL, so no gap inside
one can end a session: sessions computed from buckets are the sessions of the reports.

The volunteer page reads both: reports older than the retention horizon count per bucket
whether or not the retention job has folded them yet, newer ones count one by one. So the
page is the same before and after the job runs, and the recent part keeps its detail.

:class:`Bucket`, :func:`summarize`, :func:`merge` and :func:`contribution` are pure.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from sqlalchemy import select
from sqlalchemy.orm import Session

from peer.formats.rates import rate_between
from server.models import ProgressReport, ReportRollup
from server.schemas_dashboard import VolunteerSeries


@dataclass(frozen=True, slots=True)
class Bucket:
    """Reports of one peer within ``[bucket_ms, bucket_ms + width)``, in time order."""

    peer_pk: int
    bucket_ms: int
    first_ms: int
    last_ms: int
    reports: int
    first_samples: int
    last_samples: int
    # Samples banked by counter resets between these reports (not before the first).
    banked: int


def bucket_width_ms(online_ttl_s: float) -> int:
    """Buckets no wider than the online TTL, so that sessions survive the rollup."""
    return max(1, int(online_ttl_s * 1000))


def horizon_ms(now_ms: int, retention_s: float | None, width_ms: int) -> int | None:
    """Reports before this instant count per bucket (a bucket boundary); None: none do."""
    if retention_s is None:
        return None
    return (now_ms - int(retention_s * 1000)) // width_ms * width_ms


def single(peer_pk: int, reported_ms: int, samples: int) -> Bucket:
    return Bucket(peer_pk, reported_ms, reported_ms, reported_ms, 1, samples, samples, 0)


def from_row(row: ReportRollup) -> Bucket:
    return Bucket(
        row.peer_id,
        row.bucket_ms,
        row.first_ms,
        row.last_ms,
        row.reports,
        row.first_samples,
        row.last_samples,
        row.banked,
    )


def merge(earlier: Bucket, later: Bucket) -> Bucket:
    """One bucket of the reports of both (``earlier``'s all precede ``later``'s)."""
    reset = earlier.last_samples if later.first_samples < earlier.last_samples else 0
    return Bucket(
        earlier.peer_pk,
        earlier.bucket_ms,
        earlier.first_ms,
        later.last_ms,
        earlier.reports + later.reports,
        earlier.first_samples,
        later.last_samples,
        earlier.banked + later.banked + reset,
    )


def summarize(reports: Iterable[tuple[int, int, int]], width_ms: int) -> list[Bucket]:
    """Buckets of ``reports`` (peer, reported ms, samples), given in time order; the result
    is ordered by peer and bucket."""
    found: dict[tuple[int, int], Bucket] = {}
    for pk, t, samples in reports:
        key = (pk, t // width_ms * width_ms)
        one = Bucket(pk, key[1], t, t, 1, samples, samples, 0)
        found[key] = merge(found[key], one) if key in found else one
    return [found[key] for key in sorted(found)]


def combine(stored: Iterable[Bucket], fresh: Iterable[Bucket]) -> list[Bucket]:
    """``stored`` rollups with buckets of raw reports not folded yet (which come later in
    time, except reports that reached the database late)."""
    found = {(b.peer_pk, b.bucket_ms): b for b in stored}
    for b in fresh:
        key = (b.peer_pk, b.bucket_ms)
        found[key] = merge(found[key], b) if key in found else b
    return list(found.values())


def contribution(
    buckets: Sequence[Bucket], online_ttl_s: float, points: int
) -> tuple[VolunteerSeries, list[tuple[int, int, int]]]:
    """The volunteer's cumulative samples over time (a counter that went backwards restarted
    from zero) downsampled to ``points``, one point per bucket, and its sessions (peer,
    start ms, end ms): runs of reports without a gap longer than the online TTL."""
    gap_ms = int(online_ttl_s * 1000)
    last: dict[int, int] = {}
    banked: dict[int, int] = {}
    open_sessions: dict[int, list[int]] = {}
    sessions: list[list[int]] = []
    times: list[int] = []
    totals: list[int] = []
    for b in sorted(buckets, key=lambda b: (b.first_ms, b.last_ms, b.peer_pk)):
        pk = b.peer_pk
        previous = last.get(pk)
        reset = previous if previous is not None and b.first_samples < previous else 0
        banked[pk] = banked.get(pk, 0) + b.banked + reset
        last[pk] = b.last_samples
        current = open_sessions.get(pk)
        if current is None or b.first_ms - current[2] > gap_ms:
            current = [pk, b.first_ms, b.first_ms]
            open_sessions[pk] = current
            sessions.append(current)
        current[2] = b.last_ms
        times.append(b.last_ms)
        totals.append(sum(banked.values()) + sum(last.values()))
    if len(times) > points:
        step = len(times) / points
        picks = sorted(
            {min(len(times) - 1, int(i * step)) for i in range(points)} | {len(times) - 1}
        )
        times = [times[i] for i in picks]
        totals = [totals[i] for i in picks]
    return (
        VolunteerSeries(t=[x / 1000 for x in times], samples=totals),
        [(s[0], s[1], s[2]) for s in sessions],
    )


def machine_rates(
    buckets: Sequence[Bucket], *, now_ms: int, online_ttl_s: float, window_ms: int
) -> dict[int, float]:
    """Each peer's samples/s as its counter grew over the coordinator's clock: from its
    newest report at least ``window_ms`` before its latest (else its first) to its latest,
    by :func:`peer.formats.rates.rate_between`'s rule; 0 for a peer not seen within the
    online TTL or over less than the minimum span. Counter resets bank, as in
    :func:`contribution`."""
    points: dict[int, list[tuple[int, int]]] = {}
    last: dict[int, int] = {}
    banked: dict[int, int] = {}
    for b in sorted(buckets, key=lambda b: (b.first_ms, b.last_ms, b.peer_pk)):
        pk = b.peer_pk
        previous = last.get(pk)
        reset = previous if previous is not None and b.first_samples < previous else 0
        banked[pk] = banked.get(pk, 0) + b.banked + reset
        last[pk] = b.last_samples
        points.setdefault(pk, []).append((b.last_ms, banked[pk] + b.last_samples))
    rates: dict[int, float] = {}
    online_since = now_ms - int(online_ttl_s * 1000)
    for pk, series in points.items():
        end_ms, end = series[-1]
        start_ms, start = series[0]
        for t, total in series:
            if t > end_ms - window_ms:
                break
            start_ms, start = t, total
        rate = rate_between((start_ms / 1000, start), (end_ms / 1000, end))
        rates[pk] = rate if rate is not None and end_ms >= online_since else 0.0
    return rates


def volunteer_buckets(
    session: Session,
    peer_pks: Sequence[int],
    *,
    now_ms: int,
    online_ttl_s: float,
    retention_s: float | None,
    limit: int,
) -> list[Bucket]:
    """What :func:`contribution` needs of the peers' history: their newest ``limit`` raw
    reports and, unless those do not reach back to the rollups, their newest ``limit``
    rollups."""
    if not peer_pks:
        return []
    width = bucket_width_ms(online_ttl_s)
    horizon = horizon_ms(now_ms, retention_s, width)
    rows = session.execute(
        select(
            ProgressReport.peer_id,
            ProgressReport.reported_ms,
            ProgressReport.samples,
            ProgressReport.id,
        )
        .where(ProgressReport.peer_id.in_(peer_pks), ProgressReport.rolled_up.is_(False))
        .order_by(ProgressReport.id.desc())
        .limit(limit)
    ).all()
    truncated = len(rows) == limit
    # Time order, as the retention job folds them (ties by id).
    rows = sorted(rows, key=lambda r: (r[1], r[3]))
    raw = [(int(p), int(t), int(s)) for p, t, s, _ in rows]
    old = [r for r in raw if horizon is not None and r[1] < horizon]
    recent = [single(*r) for r in raw if horizon is None or r[1] >= horizon]
    fresh = summarize(old, width)
    if truncated:
        # The oldest bucket may be cut, and rollups would leave a hole before it.
        if fresh:
            cut = min(b.bucket_ms for b in fresh)
            fresh = [b for b in fresh if b.bucket_ms != cut]
        return fresh + recent
    stored = [
        from_row(r)
        for r in session.scalars(
            select(ReportRollup)
            .where(ReportRollup.peer_id.in_(peer_pks))
            .order_by(ReportRollup.bucket_ms.desc())
            .limit(limit)
        )
    ]
    return combine(stored, fresh) + recent
