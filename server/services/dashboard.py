"""The documents behind the pages: the runs list, a run's dashboard, a volunteer's page.

Cost: every query is bounded by an index and by the run's peers, volunteers, snapshots (the
chart history, downsampled) or a fixed number of recent rows — never by the number of raw
reports stored (kept ``report_retention_s``, then folded into rollups).
``bench/dashboard.py`` measures it.

The alert rules and the ETA are pure functions of numbers, tested without a database.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

from sqlalchemy import case, func, select
from sqlalchemy.orm import Session

from server.clock import ms_to_datetime, now_ms
from server.exceptions import NotFound
from server.models import EpochSummary, Peer, ProgressReport, ProgressSnapshot, Run, Volunteer
from server.schemas_dashboard import (
    Alert,
    CheckpointSummary,
    GroupSizeCount,
    GroupSizes,
    Headline,
    MachineRow,
    RunDashboard,
    RunHeader,
    RunRef,
    RunRow,
    RunsOverview,
    Series,
    SessionRow,
    VolunteerDetail,
    VolunteerPage,
    VolunteerRow,
    VolunteerSummary,
)
from server.services import averaging_health, presence, rollups, volunteer_table
from server.services import checkpoints as checkpoint_service
from server.services import runs as run_service
from server.services.progress import history
from server.services.run_totals import RATE_WINDOW_MS, float_sum, run_totals, saturated
from server.services.volunteer_table import Row, View

DEFAULT_VIEW = View()

RECENT_GROUP_REPORTS = 200  # reports behind the group-size distribution
RECENT_EPOCHS = 10  # epochs behind the ETA and the rounds-failing alert
TREND_POINTS = 30  # samples/s points of the runs list's sparkline
VOLUNTEER_REPORTS = 20_000  # newest reports (and rollups) behind a volunteer's chart
STALL_AFTER_S = 120.0  # a running run with no report for this long is stalled
MAX_ID = 2**31 - 1  # volunteers' ids are 32-bit integers on every backend
# The pages call a peer online if it was seen this recently (or within the online TTL, if
# shorter). A volunteer reports every 10 s while it trains or waits out a pause
# (report_interval_s, told to volunteers at join), so one that left or whose process died is shown
# offline within this time, not the TTL; one late or lost report does not blink it offline.
PRESENCE_S = 25.0


def presence_s(online_ttl_s: float) -> float:
    return min(online_ttl_s, PRESENCE_S)


# ----------------------------------------------------------------------------- pure rules


def eta_seconds(
    epoch: int,
    target_epochs: int | None,
    epoch_starts_ms: Sequence[int],
    *,
    stalled: bool = False,
) -> float | None:
    """Seconds until ``target_epochs`` at the pace of the recent epochs (their start times,
    in any order); 0 once reached; None without a target or two epochs to measure, or while
    the run is ``stalled`` (running with no volunteer online: no pace to promise).

    The pace is the median time between two epochs' starts: an epoch that spanned a pause
    (or an outage) is one long gap among many and leaves the estimate as it was."""
    if target_epochs is None:
        return None
    if epoch >= target_epochs:
        return 0.0
    if stalled:
        return None
    starts = sorted(epoch_starts_ms)
    if len(starts) < 2 or starts[-1] <= starts[0]:
        return None
    per_epoch_s = statistics.median(b - a for a, b in itertools.pairwise(starts)) / 1000
    if per_epoch_s <= 0:
        return None
    return (target_epochs - epoch) * per_epoch_s


@dataclass(frozen=True, slots=True)
class AlertInputs:
    running: bool
    loss_nan_peers: int
    losses: Sequence[float | None]  # chart history, oldest first
    peers_online: Sequence[int]  # chart history, oldest first
    current_peers: int
    rounds: Sequence[tuple[int, int]]  # (done, failed) of recent epochs
    seconds_since_last_report: float | None


def alerts(inputs: AlertInputs) -> list[Alert]:
    """What an organizer should look at now, most severe first."""
    found: list[Alert] = []
    if inputs.loss_nan_peers:
        found.append(
            Alert(
                kind="loss_nan",
                severity="critical",
                message=f"The loss is NaN or infinite on {inputs.loss_nan_peers} peer(s).",
            )
        )
    losses = [x for x in inputs.losses if x is not None]
    if len(losses) >= 6:
        before = statistics.median(losses[-11:-1])
        latest = losses[-1]
        if before > 0 and latest > 2 * before:
            found.append(
                Alert(
                    kind="loss_jump",
                    severity="warning",
                    message=f"The loss jumped to {latest:.4g} from about {before:.4g}.",
                )
            )
    recent_peers = list(inputs.peers_online[-20:])
    if recent_peers:
        peak = max(recent_peers)
        if peak >= 2 and inputs.current_peers <= peak // 2:
            found.append(
                Alert(
                    kind="peers_collapse",
                    severity="critical" if inputs.current_peers == 0 else "warning",
                    message=f"Peers online fell to {inputs.current_peers} from {peak}.",
                )
            )
    done = sum(d for d, _ in inputs.rounds)
    failed = sum(f for _, f in inputs.rounds)
    if done + failed >= 4 and failed > done:
        found.append(
            Alert(
                kind="rounds_failing",
                severity="warning",
                message=f"Most recent averaging rounds failed ({failed} of {done + failed}).",
            )
        )
    idle = inputs.seconds_since_last_report
    if inputs.running and idle is not None and idle > STALL_AFTER_S:
        found.append(
            Alert(
                kind="stalled",
                severity="warning",
                message=f"No progress report for {idle / 60:.0f} min.",
            )
        )
    found.sort(key=lambda a: a.severity != "critical")
    return found


# ----------------------------------------------------------------------------- queries


def _table_rows(rows: list[Row], total_samples: int) -> list[VolunteerRow]:
    return [
        VolunteerRow(
            id=v.id,
            display_name=v.display_name,
            samples=v.samples,
            share=_share(v.samples, total_samples),
            online_s=v.online_ms / 1000,
            last_seen=None if v.last_seen_ms is None else ms_to_datetime(v.last_seen_ms),
            online=v.online,
            reachable=v.reachable_peers > 0,
            behind_nat=v.punching_peers > 0,
            peers=v.peers,
            banned=v.banned,
        )
        for v in rows
    ]


def _share(samples: int, total: int) -> float:
    return samples / total if total > 0 else 0.0


def _version(document: RunDashboard | RunsOverview) -> str:
    # What changes with the data, not with the clock: ``now`` and the checkpoint's age are
    # left out, so an idle run's version stays put and live clients get nothing new.
    exclude: dict[str, bool | dict[str, set[str]]] = {"version": True, "now": True}
    if isinstance(document, RunDashboard):
        exclude["headline"] = {"checkpoint": {"age_s"}}
    data = document.model_dump_json(exclude=exclude)
    return hashlib.blake2b(data.encode(), digest_size=8).hexdigest()


def _training_rate(run: Run, rate: float) -> float:
    """A paused or finished run trains nothing, whatever its peers' last reports said."""
    return rate if run.status.value == "running" and run.archived_at is None else 0.0


def target_epochs(run: Run) -> int | None:
    return run_service.last_epoch(run.config)


def _status_detail(session: Session, runs: Sequence[Run], online_ttl_s: float) -> dict[str, str]:
    """Why each of ``runs`` is in its status, where there is more to say than the status
    (:func:`server.services.runs.status_detail`); one count for the runs that wait."""
    online = run_service.volunteers_online(
        session,
        [r.id for r in runs if run_service.waiting(r)],
        online_ttl_s=online_ttl_s,
        ready=True,
    )
    found = {r.id: run_service.status_detail(r, online.get(r.id, 0)) for r in runs}
    return {run_id: text for run_id, text in found.items() if text}


def run_algorithm(run: Run) -> str:
    """How the run's peers train (its config's ``algorithm``; collaborative by default)."""
    value = (run.config or {}).get("algorithm")
    return value if value in ("collaborative", "diloco") else "collaborative"


def run_dashboard(
    session: Session,
    run: Run,
    *,
    online_ttl_s: float,
    history_points: int,
    view: View = DEFAULT_VIEW,
) -> RunDashboard:
    """Headline, alerts, charts and one page of the volunteers' table (``view``)."""
    now = now_ms()
    detail = _status_detail(session, [run], online_ttl_s)
    online_ttl_s = presence_s(online_ttl_s)
    totals = run_totals(session, run.id, now, online_ttl_s)
    since = now - int(online_ttl_s * 1000)
    loss_nan_peers, last_report_ms = session.execute(
        select(
            func.coalesce(
                func.sum(case((Peer.loss_nan.is_(True) & presence.online(since), 1), else_=0)),
                0,
            ),
            func.max(Peer.last_report_ms),
        ).where(Peer.run_id == run.id)
    ).one()
    epochs = session.scalars(
        select(EpochSummary)
        .where(EpochSummary.run_id == run.id)
        .order_by(EpochSummary.epoch.desc())
        .limit(RECENT_EPOCHS)
    ).all()
    group_sizes = [
        int(g)
        for g in session.scalars(
            select(ProgressReport.group_size)
            .where(ProgressReport.run_id == run.id)
            .order_by(ProgressReport.id.desc())
            .limit(RECENT_GROUP_REPORTS)
        )
        if g is not None
    ][::-1]
    counts: dict[int, int] = {}
    for size in group_sizes:
        counts[size] = counts.get(size, 0) + 1
    points = history(session, run.id, history_points)
    series = Series(
        t=[p.t.timestamp() for p in points],
        samples=[p.samples for p in points],
        samples_per_second=[p.samples_per_second for p in points],
        peers_online=[p.peers_online for p in points],
        loss=[p.loss for p in points],
        eval_metric=[p.eval_metric for p in points],
        mean_group_size=[p.mean_group_size for p in points],
        rounds_done=[p.rounds_done for p in points],
        rounds_failed=[p.rounds_failed for p in points],
    )
    checkpoint = checkpoint_service.served(session, run.id)
    target = target_epochs(run)
    headline = Headline(
        # A checkpoint is uploaded once its epoch is complete: the run is at least there.
        epoch=max(totals.epoch, 0 if checkpoint is None else checkpoint.epoch),
        samples=totals.samples,
        samples_per_second=_training_rate(run, totals.samples_per_second),
        compute_samples_per_second=totals.compute_samples_per_second,
        peers_online=totals.peers_online,
        loss=totals.loss,
        eval_metric=totals.eval_metric,
        rounds_done=totals.rounds_done,
        rounds_failed=totals.rounds_failed,
        bytes_per_sample=totals.bytes_per_sample,
        eta_s=eta_seconds(
            totals.epoch,
            target,
            [e.first_report_ms for e in epochs],
            stalled=run.status.value == "running" and totals.peers_online == 0,
        ),
        checkpoint=None
        if checkpoint is None
        else CheckpointSummary(
            epoch=checkpoint.epoch,
            created_at=checkpoint.created_at,
            age_s=max(0.0, now / 1000 - checkpoint.created_at.timestamp()),
            size=checkpoint.size,
            sha256=checkpoint.sha256,
        ),
    )
    found = alerts(
        AlertInputs(
            running=run.status.value == "running" and run.archived_at is None,
            loss_nan_peers=int(loss_nan_peers),
            losses=series.loss,
            peers_online=series.peers_online,
            current_peers=totals.peers_online,
            rounds=[(e.rounds_done, e.rounds_failed) for e in epochs[:3]],
            seconds_since_last_report=None
            if last_report_ms is None
            else (now - int(last_report_ms)) / 1000,
        )
    )
    if run.status.value == "running" and run.archived_at is None:
        found += averaging_health.alerts(
            session, run.id, now=now, since=since, online=totals.peers_online
        )
        found.sort(key=lambda a: a.severity != "critical")
    volunteers, info = volunteer_table.page(session, run.id, since, view)
    document = RunDashboard(
        run=RunHeader(
            id=run.id,
            name=run.name,
            task=run.task,
            status=run.status,
            status_detail=detail.get(run.id),
            created_at=run.created_at,
            target_epochs=target,
            algorithm=run_algorithm(run),
        ),
        now=ms_to_datetime(now),
        version="",
        headline=headline,
        alerts=found,
        series=series,
        group_sizes=GroupSizes(
            recent=group_sizes,
            histogram=[GroupSizeCount(size=s, count=c) for s, c in sorted(counts.items())],
        ),
        volunteers_page=info,
        volunteers=_table_rows(volunteers, totals.samples),
    )
    document.version = _version(document)
    return document


def volunteers_page(
    session: Session, run: Run, *, online_ttl_s: float, view: View
) -> VolunteerPage:
    """One page of the run's volunteers' table, as the dashboard's document carries it."""
    now = now_ms()
    since = now - int(presence_s(online_ttl_s) * 1000)
    total_samples = saturated(
        session.scalar(
            select(float_sum(Peer.samples_base + Peer.samples)).where(Peer.run_id == run.id)
        )
    )
    rows, info = volunteer_table.page(session, run.id, since, view)
    return VolunteerPage(
        now=ms_to_datetime(now), volunteers_page=info, volunteers=_table_rows(rows, total_samples)
    )


def with_page(document: bytes | str, page: VolunteerPage) -> str:
    """A run's dashboard document (JSON, as :func:`run_dashboard` made it for the default
    view) with ``page`` of the volunteers' table in place of its own; its ``version`` covers
    the page too. The run-wide part is not rebuilt, so a reader who asks for many views
    costs one table query each."""
    data = json.loads(document)
    table = page.model_dump(mode="json", include={"volunteers_page", "volunteers"})
    data.update(table)
    digest = hashlib.blake2b(digest_size=8)
    digest.update(str(data["version"]).encode())
    digest.update(json.dumps(table, sort_keys=True).encode())
    data["version"] = digest.hexdigest()
    return json.dumps(data, separators=(",", ":"))


def runs_overview(session: Session, *, online_ttl_s: float) -> RunsOverview:
    now = now_ms()
    runs = run_service.list_runs(session, include_archived=False)
    details = _status_detail(session, runs, online_ttl_s)
    online_ttl_s = presence_s(online_ttl_s)
    rows = []
    for run in runs:
        totals = run_totals(session, run.id, now, online_ttl_s)
        trend = session.scalars(
            select(ProgressSnapshot.samples_per_second)
            .where(ProgressSnapshot.run_id == run.id)
            .order_by(ProgressSnapshot.taken_ms.desc())
            .limit(TREND_POINTS)
        ).all()
        rows.append(
            RunRow(
                id=run.id,
                name=run.name,
                status=run.status,
                status_detail=details.get(run.id),
                task=run.task,
                epoch=totals.epoch,
                samples=totals.samples,
                peers_online=totals.peers_online,
                samples_per_second=_training_rate(run, totals.samples_per_second),
                compute_samples_per_second=totals.compute_samples_per_second,
                trend=[float(x) for x in reversed(trend)],
            )
        )
    document = RunsOverview(runs=rows, version="")
    document.version = _version(document)
    return document


def find_volunteer(session: Session, run: Run, ref: str) -> Volunteer:
    """By numeric id, else by exact display name (the oldest volunteer of that name)."""
    volunteer = None
    if ref.isdigit() and int(ref) <= MAX_ID:
        volunteer = session.get(Volunteer, int(ref))
        if volunteer is not None and volunteer.run_id != run.id:
            volunteer = None
    if volunteer is None:
        volunteer = session.scalars(
            select(Volunteer)
            .where(Volunteer.run_id == run.id, Volunteer.display_name == ref)
            .order_by(Volunteer.id)
            .limit(1)
        ).first()
    if volunteer is None:
        raise NotFound(f"run {run.id} has no volunteer {ref!r}")
    return volunteer


def volunteer_detail(
    session: Session,
    run: Run,
    ref: str,
    *,
    online_ttl_s: float,
    retention_s: float | None = None,
    points: int = 200,
) -> VolunteerDetail:
    """The volunteer's standing, machines, sessions and contribution chart; reports older
    than ``retention_s`` count per bucket (server.services.rollups), so the page reads the
    same before and after the retention job folds them."""
    volunteer = find_volunteer(session, run, ref)
    now = now_ms()
    since = now - int(presence_s(online_ttl_s) * 1000)
    place = volunteer_table.standing(session, run.id, volunteer.id, since)
    assert place is not None  # find_volunteer found it in this run
    me = place.row
    peers = list(
        session.scalars(select(Peer).where(Peer.volunteer_id == volunteer.id).order_by(Peer.id))
    )
    by_pk = {p.id: p for p in peers}
    buckets = rollups.volunteer_buckets(
        session,
        list(by_pk),
        now_ms=now,
        online_ttl_s=online_ttl_s,
        retention_s=retention_s,
        limit=VOLUNTEER_REPORTS,
    )
    series, sessions = rollups.contribution(buckets, online_ttl_s, points)
    rates = rollups.machine_rates(
        buckets, now_ms=now, online_ttl_s=online_ttl_s, window_ms=RATE_WINDOW_MS
    )
    return VolunteerDetail(
        run=RunRef(id=run.id, name=run.name),
        volunteer=VolunteerSummary(
            id=volunteer.id,
            display_name=volunteer.display_name,
            samples=me.samples,
            share=_share(me.samples, place.total_samples),
            rank=place.rank,
            of=place.of,
            online_s=me.online_ms / 1000,
            first_seen=None if me.first_seen_ms is None else ms_to_datetime(me.first_seen_ms),
            last_seen=None if me.last_seen_ms is None else ms_to_datetime(me.last_seen_ms),
            banned=volunteer.banned_at is not None,
        ),
        series=series,
        sessions=[
            SessionRow(
                peer_id=by_pk[pk].peer_id,
                started=ms_to_datetime(start),
                ended=None if end >= since else ms_to_datetime(end),
                duration_s=(end - start) / 1000,
            )
            for pk, start, end in sessions
        ],
        machines=[
            MachineRow(
                peer_id=p.peer_id,
                addresses=list(p.addresses or []),
                reachable=not p.client_mode and not _punching(p.addresses),
                behind_nat=not p.client_mode and _punching(p.addresses),
                client_mode=p.client_mode,
                epoch=p.epoch,
                samples=p.samples_base + p.samples,
                samples_per_second=rates.get(p.id, 0.0),
                compute_samples_per_second=p.samples_per_second,
                compute_utilisation=p.compute_utilisation,
                group_size=p.group_size,
                last_seen=ms_to_datetime(p.last_seen_ms),
                online=presence.is_online(p, since),
            )
            for p in peers
        ],
    )


def _punching(addresses: list[str] | None) -> bool:
    """Behind a NAT, reached by hole punching (the rendezvous's punch:// address)."""
    return any(address.startswith("punch://") for address in addresses or ())
