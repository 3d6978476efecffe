"""Admitting progress reports: the plausibility bounds (:mod:`server.services.report_bounds`)
and the credit bound (:mod:`server.services.credit_rates`) applied with what one worker knows.

Without a database round trip on the hot path: a peer's :class:`PeerTrack` is read when its
token is verified and kept up to date by the reports admitted; a run's :class:`SwarmView`
and measured rates are read at most every ``refresh_s``. A report the epoch bound refuses
lifts its volunteer in the view to that bound (:func:`lift_on_refusal`), so a swarm ahead of
what the database holds is not refused for good.

With several workers a track may be older than the database: that only loosens the check,
and the write clamps every peer's total to the same bound (``PendingReport.samples_cap``).
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import replace

from sqlalchemy import case, func, select
from sqlalchemy.orm import Session, sessionmaker

from server.clock import now_ms
from server.exceptions import ImplausibleReport, Unavailable
from server.models import Peer, Volunteer, table_of
from server.schemas import ReportCreate
from server.services import presence
from server.services.credit_rates import CreditLimits, Measured, RunRates
from server.services.report_bounds import (
    Bound,
    PeerTrack,
    Refusal,
    ReportLimits,
    SwarmView,
    check,
    lift_on_refusal,
    swarm_epoch,
)
from server.services.report_buffer import ReportBuffer
from server.services.reports import PendingReport, pending_report

logger = logging.getLogger(__name__)

# Peers remembered per worker; beyond, the oldest are forgotten (and read again when needed).
MAX_TRACKS = 100_000
# A report refused for a group larger than the run's peers reads them again first, at most
# this often (five reads a second per run and worker at most): a peer that joined since the
# view was read may be in the group.
GROUP_REFRESH_MS = 200
# A volunteer's refused reports are logged at most once per this time (then with a count).
REFUSAL_LOG_INTERVAL_MS = 10_000


def load_track(session: Session, peer_pk: int) -> PeerTrack:
    """The peer's track as the database has it."""
    row = session.execute(
        select(
            Peer.first_seen_ms,
            Peer.volunteer_id,
            Peer.samples_base,
            Peer.samples,
            Peer.last_report_ms,
        ).where(Peer.id == peer_pk)
    ).one()
    return PeerTrack(
        first_seen_ms=int(row[0]),
        volunteer_id=int(row[1]),
        banked=int(row[2]),
        samples=int(row[3]),
        as_of_ms=None if row[4] is None else int(row[4]),
        credited=int(row[2]) + int(row[3]),
    )


def load_rates(session: Session, run_id: str, now: int, online_ttl_s: float) -> RunRates:
    """The run's measured volunteer rates as the database has them: one grouped query over
    the run's peers (volunteers with a peer online, not banned)."""
    peers = table_of(Peer)
    volunteers = table_of(Volunteer)
    online = presence.online(now - int(online_ttl_s * 1000))
    rows = session.execute(
        select(
            peers.c.volunteer_id,
            func.sum(peers.c.samples_base + peers.c.samples),
            func.max(peers.c.last_report_ms) - func.min(peers.c.first_seen_ms),
            volunteers.c.join_token_id,
        )
        .join(volunteers, volunteers.c.id == peers.c.volunteer_id)
        .where(
            peers.c.run_id == run_id,
            peers.c.last_report_ms.is_not(None),
            volunteers.c.banned_at.is_(None),
        )
        .group_by(peers.c.volunteer_id, volunteers.c.join_token_id)
        .having(func.max(case((online, 1), else_=0)) == 1)
    ).all()
    return RunRates.of(
        now,
        [
            Measured(int(v), int(n or 0), int(span or 0), "" if invite is None else str(invite))
            for v, n, span, invite in rows
        ],
    )


def count_peers(session: Session, run_id: str) -> int:
    """How many peers (machines) ever joined the run: no averaging group is larger."""
    peers = table_of(Peer)
    return int(session.execute(select(func.count()).where(peers.c.run_id == run_id)).scalar_one())


def load_view(session: Session, run_id: str, now: int, online_ttl_s: float) -> SwarmView:
    """The run's epochs as the database has them: one query over the run's peers."""
    peers = table_of(Peer)
    online = presence.online(now - int(online_ttl_s * 1000))
    rows = session.execute(
        select(
            peers.c.volunteer_id,
            func.max(case((online, peers.c.epoch), else_=None)),
            func.max(peers.c.epoch),
        )
        .where(peers.c.run_id == run_id, peers.c.last_report_ms.is_not(None))
        .group_by(peers.c.volunteer_id)
    ).all()
    joined = count_peers(session, run_id)
    return SwarmView(
        read_ms=now,
        online={int(v): int(e) for v, e, _ in rows if e is not None},
        highest=max((int(h) for _, _, h in rows), default=0),
        peers=joined,
    )


class ReportGuard:
    """One worker's admission of reports. :meth:`admit` is the route's (it may read the
    database); :meth:`admit_known` the fast path's (never does, and defers when it would)."""

    def __init__(
        self,
        session_factory: sessionmaker[Session],
        limits: ReportLimits,
        *,
        refresh_s: float,
        online_ttl_s: float,
        credit: CreditLimits | None = None,
    ) -> None:
        self._session_factory = session_factory
        self.limits = limits
        # None: credit bounded by ``limits`` alone.
        self.credit = credit
        self._rates: dict[str, RunRates] = {}
        self._rates_reading: dict[str, asyncio.Future[RunRates]] = {}
        self._refresh_ms = int(refresh_s * 1000)
        self._online_ttl_s = online_ttl_s
        self._tracks: dict[int, PeerTrack] = {}
        self._views: dict[str, SwarmView] = {}
        # Per run: when its peers were last counted for the group-size bound.
        self._recounted: dict[str, int] = {}
        # Per peer: when its refusals were last logged, and how many since.
        self._refusals_logged: dict[int, tuple[int, int]] = {}

    def remember(self, peer_pk: int, track: PeerTrack) -> None:
        """Take a track read from the database (:func:`load_track`), unless this worker
        knows a newer one. Call it on the event loop."""
        known = self._tracks.get(peer_pk)
        if known is not None and (track.as_of_ms or 0) <= (known.as_of_ms or 0):
            return
        self._store(peer_pk, track)

    def admit_known(self, run_id: str, peer_pk: int, body: ReportCreate) -> PendingReport | None:
        """The report to queue if everything needed is at hand and it passes; None means
        "ask :meth:`admit`" (unknown peer or run, or a report that would be refused: only
        :meth:`admit` refuses, looking again first, and lifts the volunteer)."""
        track = self._tracks.get(peer_pk)
        view = self._views.get(run_id)
        if track is None or view is None:
            return None
        now = now_ms()
        if self.credit is not None:
            rates = self._rates.get(run_id)
            if rates is None or now - rates.read_ms >= self._refresh_ms:
                return None
        if self._judge(track, view, body, now) is not None:
            return None
        return self._accept(run_id, peer_pk, track, body, now)

    async def admit(self, run_id: str, peer_pk: int, body: ReportCreate) -> PendingReport:
        """The report to queue; :class:`ImplausibleReport` (422) if it breaks a bound."""
        track = self._tracks.get(peer_pk)
        if track is None:
            self.remember(peer_pk, await asyncio.to_thread(self._read_track, peer_pk))
            track = self._tracks[peer_pk]
        view = self._views.get(run_id)
        now = now_ms()
        if view is None:
            view = await self._refresh(run_id, now)
        refusal = self._judge(track, view, body, now)
        if refusal is not None and view is not None and now - view.read_ms >= self._refresh_ms:
            # Judged on an old view of the swarm: look again before refusing.
            view = await self._refresh(run_id, now)
            refusal = self._judge(track, view, body, now)
        # For the group size, only the count of peers, never a new view: a new view resets
        # who was lifted by the epoch bound in it, and a liar could climb a lead per recount.
        if (
            refusal is not None
            and refusal.bound is Bound.group_size
            and view is not None
            and await self._recount(run_id, view, now)
        ):
            refusal = self._judge(track, view, body, now)
        if refusal is not None:
            if refusal.bound is Bound.epoch and view is not None:
                lift_on_refusal(self.limits, view, track.volunteer_id, body.epoch, now)
            await self._log_refusal(run_id, peer_pk, track.volunteer_id, refusal, now)
            raise ImplausibleReport(refusal.bound, refusal.detail)
        if self.credit is not None:
            await self._fresh_rates(run_id, now)
        return self._accept(run_id, peer_pk, track, body, now)

    async def _fresh_rates(self, run_id: str, now: int) -> None:
        """Read the run's measured rates again if this worker's are ``refresh_s`` old, one
        read per run at a time (the reports arriving meanwhile wait for it: stale rates
        could judge a forger by the floor). A read that fails keeps the rates at hand for
        another ``refresh_s`` (none: the floor), so a database outage costs a run's reports
        one failed read per interval, not one each."""
        rates = self._rates.get(run_id)
        if rates is not None and now - rates.read_ms < self._refresh_ms:
            return
        reading = self._rates_reading.get(run_id)
        if reading is None:

            def read() -> RunRates:
                try:
                    with self._session_factory() as session:
                        return load_rates(session, run_id, now, self._online_ttl_s)
                except Exception:
                    logger.warning("cannot read the rates of run %s", run_id, exc_info=True)
                    return replace(rates, read_ms=now) if rates else RunRates(now)

            def keep(done: asyncio.Future[RunRates]) -> None:
                self._rates_reading.pop(run_id, None)
                if done.cancelled() or done.exception() is not None:
                    return
                self._rates.pop(run_id, None)
                self._rates[run_id] = done.result()
                if len(self._rates) > MAX_TRACKS:
                    del self._rates[next(iter(self._rates))]

            reading = asyncio.ensure_future(asyncio.to_thread(read))
            self._rates_reading[run_id] = reading
            reading.add_done_callback(keep)
        await asyncio.shield(reading)

    async def _recount(self, run_id: str, view: SwarmView, now: int) -> bool:
        """Read the run's peers into ``view`` again unless that was done less than
        ``GROUP_REFRESH_MS`` ago; whether it was."""
        if now - self._recounted.get(run_id, 0) < GROUP_REFRESH_MS:
            return False
        self._recounted[run_id] = now

        def read() -> int:
            with self._session_factory() as session:
                return count_peers(session, run_id)

        try:
            view.peers = max(view.peers, await asyncio.to_thread(read))
        except Exception:
            logger.warning("cannot count the peers of run %s", run_id, exc_info=True)
            return False
        return True

    async def _log_refusal(
        self, run_id: str, peer_pk: int, volunteer_id: int, refusal: Refusal, now: int
    ) -> None:
        """One warning naming the volunteer and its machine, at most every
        ``REFUSAL_LOG_INTERVAL_MS`` per peer (a flood of refused reports is one line, with
        its count, per interval)."""
        logged_ms, since = self._refusals_logged.get(peer_pk, (None, 0))
        if logged_ms is not None and now - logged_ms < REFUSAL_LOG_INTERVAL_MS:
            self._refusals_logged[peer_pk] = (logged_ms, since + 1)
            return
        self._refusals_logged.pop(peer_pk, None)
        self._refusals_logged[peer_pk] = (now, 0)
        if len(self._refusals_logged) > MAX_TRACKS:
            del self._refusals_logged[next(iter(self._refusals_logged))]
        try:
            name, peer_id = await asyncio.to_thread(self._read_names, peer_pk)
        except Exception:  # the database is down: the ids still name them
            name, peer_id = "?", "?"
        more = f" ({since} more refused since the last such line)" if since else ""
        logger.warning(
            "refused a report of volunteer %d (%r), peer %s, in run %s, bound %s: %s%s",
            volunteer_id,
            name,
            peer_id,
            run_id,
            refusal.bound,
            refusal.detail,
            more,
        )

    def _read_names(self, peer_pk: int) -> tuple[str, str]:
        with self._session_factory() as session:
            row = session.execute(
                select(Volunteer.display_name, Peer.peer_id)
                .join(Volunteer, Volunteer.id == Peer.volunteer_id)
                .where(Peer.id == peer_pk)
            ).one()
            return str(row[0]), str(row[1])

    async def swarm_epoch(self, run_id: str, volunteer_id: int, *, at_least: int) -> int | None:
        """The swarm's epoch as the epoch bound sees it for a report of ``volunteer_id``
        (:func:`~server.services.report_bounds.swarm_epoch`); the view is read again first
        when the one at hand puts it below ``at_least``. None while the database never
        answered. (Checkpoint uploads are judged by it.)"""
        view = self._views.get(run_id)
        if view is None or swarm_epoch(view, volunteer_id) < at_least:
            view = await self._refresh(run_id, now_ms())
        return None if view is None else swarm_epoch(view, volunteer_id)

    def _judge(
        self, track: PeerTrack, view: SwarmView | None, body: ReportCreate, now: int
    ) -> Refusal | None:
        return check(
            self.limits,
            track,
            view,
            epoch=body.epoch,
            samples=body.samples,
            samples_per_second=body.samples_per_second,
            now_ms=now,
            rounds=body.rounds_done + body.rounds_failed,
            loss=body.loss,
            eval_metric=body.eval_metric,
            group_size=body.group_size,
        )

    def _accept(
        self, run_id: str, peer_pk: int, track: PeerTrack, body: ReportCreate, now: int
    ) -> PendingReport:
        cap = self.limits.samples_cap(track.first_seen_ms, now)
        rate: float | None = None
        if self.credit is not None:
            rate = self.credit.limit(self._rates.get(run_id), track.volunteer_id)
            cap = min(cap, self.credit.cap(rate, track.first_seen_ms, now, track.credited))
        report = pending_report(
            run_id, peer_pk, body, reported_ms=now, samples_cap=cap, rate_cap=rate
        )
        credited = min(cap, track.contribution_after(body.samples))
        self._store(peer_pk, track.after(body.samples, now, credited))
        view = self._views.get(run_id)
        if view is not None:
            view.saw(track.volunteer_id, body.epoch, now)
        return report

    def _store(self, peer_pk: int, track: PeerTrack) -> None:
        self._tracks.pop(peer_pk, None)
        self._tracks[peer_pk] = track
        if len(self._tracks) > MAX_TRACKS:
            del self._tracks[next(iter(self._tracks))]

    def _read_track(self, peer_pk: int) -> PeerTrack:
        with self._session_factory() as session:
            return load_track(session, peer_pk)

    async def _refresh(self, run_id: str, now: int) -> SwarmView | None:
        def read() -> SwarmView:
            with self._session_factory() as session:
                return load_view(session, run_id, now, self._online_ttl_s)

        try:
            view = await asyncio.to_thread(read)
        except Exception:
            # The database is down: judge by the last view if any (the epoch not at all
            # without one), rather than refuse honest peers.
            logger.warning("cannot read the swarm's epochs of run %s", run_id, exc_info=True)
            return self._views.get(run_id)
        older = self._views.get(run_id)
        if older is not None:
            view.carry(older, now - int(self._online_ttl_s * 1000))
        self._views[run_id] = view
        return view


async def take_report(
    guard: ReportGuard,
    buffer: ReportBuffer,
    run_id: str,
    peer_pk: int,
    body: ReportCreate,
    *,
    at_hand: bool = False,
) -> bool:
    """The one way a progress report enters the coordinator, for the report route and its
    fast path (:class:`~server.api.fast_reports.ReportFastPath`): admit ``body`` past the
    bounds, then queue it for writing; True once queued.

    ``at_hand`` is the fast path's: judge only with what this worker holds
    (:meth:`ReportGuard.admit_known`), and return False (hand the request to the route)
    rather than read the database, refuse or answer 503. Otherwise (the route)
    :class:`~server.exceptions.ImplausibleReport` (422, counted against the peer) or
    :class:`~server.exceptions.Unavailable` (503)."""
    if at_hand:
        report = guard.admit_known(run_id, peer_pk, body)
        if report is None:
            return False
    else:
        try:
            report = await guard.admit(run_id, peer_pk, body)
        except ImplausibleReport as refused:
            buffer.count_refusal(peer_pk, refused.bound, now_ms())
            raise
    try:
        await buffer.add(report)
    except Unavailable:
        if at_hand:
            return False
        raise
    return True
