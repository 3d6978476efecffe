"""The run's progress for dashboards and progress bars: current totals from the peers'
latest reports, recent epochs, and chart history downsampled from progress snapshots."""

from __future__ import annotations

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from server.clock import ms_to_datetime, now_ms
from server.models import EpochSummary, ProgressReport, ProgressSnapshot, Run
from server.schemas import EpochPublic, HistoryPoint, ProgressPublic
from server.services import checkpoints as checkpoint_service
from server.services.run_totals import run_totals

RECENT_GROUP_SIZES = 20
RECENT_EPOCHS = 20


def progress(
    session: Session, run: Run, *, online_ttl_s: float, history_points: int
) -> ProgressPublic:
    totals = run_totals(session, run.id, now_ms(), online_ttl_s)
    group_sizes = session.scalars(
        select(ProgressReport.group_size)
        .where(ProgressReport.run_id == run.id, ProgressReport.group_size.is_not(None))
        .order_by(ProgressReport.id.desc())
        .limit(RECENT_GROUP_SIZES)
    ).all()
    epochs = session.scalars(
        select(EpochSummary)
        .where(EpochSummary.run_id == run.id)
        .order_by(EpochSummary.epoch.desc())
        .limit(RECENT_EPOCHS)
    ).all()
    checkpoint = checkpoint_service.served(session, run.id)
    return ProgressPublic(
        run_id=run.id,
        status=run.status,
        epoch=totals.epoch,
        samples=totals.samples,
        samples_per_second=totals.samples_per_second,
        compute_samples_per_second=totals.compute_samples_per_second,
        peers_online=totals.peers_online,
        loss=totals.loss,
        eval_metric=totals.eval_metric,
        rounds_done=totals.rounds_done,
        rounds_failed=totals.rounds_failed,
        bytes_per_sample=totals.bytes_per_sample,
        checkpoint=None if checkpoint is None else checkpoint_service.public(checkpoint),
        recent_group_sizes=[int(g) for g in reversed(group_sizes) if g is not None],
        epochs=[
            EpochPublic(
                epoch=e.epoch,
                started_at=ms_to_datetime(e.first_report_ms),
                last_report_at=ms_to_datetime(e.last_report_ms),
                reports=e.reports,
                mean_loss=e.loss_sum / e.loss_count if e.loss_count else None,
                max_group_size=e.max_group_size,
                rounds_done=e.rounds_done,
                rounds_failed=e.rounds_failed,
            )
            for e in reversed(epochs)
        ],
        history=history(session, run.id, history_points),
    )


def history(session: Session, run_id: str, points: int) -> list[HistoryPoint]:
    """At most ``points`` points, oldest first. Snapshots are grouped into equal time buckets
    (integer arithmetic on milliseconds, identical on SQLite and PostgreSQL); each bucket
    reports its last time, epoch and samples and its mean throughput, loss and peers."""
    first, last, count = session.execute(
        select(
            func.min(ProgressSnapshot.taken_ms),
            func.max(ProgressSnapshot.taken_ms),
            func.count(),
        ).where(ProgressSnapshot.run_id == run_id)
    ).one()
    if not count:
        return []
    span = int(last) - int(first) + 1
    bucket = ((ProgressSnapshot.taken_ms - int(first)) * points // span).label("bucket")
    rows = session.execute(
        select(
            func.max(ProgressSnapshot.taken_ms),
            func.max(ProgressSnapshot.epoch),
            func.max(ProgressSnapshot.samples),
            func.avg(ProgressSnapshot.samples_per_second),
            func.avg(ProgressSnapshot.loss),
            func.avg(ProgressSnapshot.peers_online),
            func.avg(ProgressSnapshot.eval_metric),
            func.avg(ProgressSnapshot.mean_group_size),
            func.max(ProgressSnapshot.rounds_done),
            func.max(ProgressSnapshot.rounds_failed),
        )
        .where(ProgressSnapshot.run_id == run_id)
        .group_by(bucket)
        .order_by(bucket)
    ).all()
    return [
        HistoryPoint(
            t=ms_to_datetime(int(t)),
            epoch=int(epoch),
            samples=int(samples),
            samples_per_second=float(sps),
            loss=None if loss is None else float(loss),
            peers_online=round(float(peers)),
            eval_metric=None if metric is None else float(metric),
            mean_group_size=None if group is None else float(group),
            rounds_done=int(done or 0),
            rounds_failed=int(failed or 0),
        )
        for t, epoch, samples, sps, loss, peers, metric, group, done, failed in rows
    ]
