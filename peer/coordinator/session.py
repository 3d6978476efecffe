"""``CoordinatorSession``: a joined peer's background conversation with the coordinator.

One daemon thread keeps the run certificate fresh, sends progress reports, watches the
run's status and, when the node has lost every peer, asks for bootstrap addresses. Training
never waits on it: :meth:`~CoordinatorSession.submit_report` only queues (a bounded
:class:`~peer.coordinator.reports.ReportQueue`), and while the coordinator is away reports
wait and are sent in order once it answers again.

Timing (:class:`SessionTimings`): the certificate is renewed when a third of its lifetime
remains; the status is polled every ``poll_interval``; every failed call is retried after
a back-off that doubles up to ``max_backoff`` (with ±20 % jitter, so that many peers do not
come back to a restarted coordinator at the same instant). The thread sleeps on a
``threading.Event``: a new report or :meth:`~CoordinatorSession.close` wakes it at once.
"""

from __future__ import annotations

import logging
import math
import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from pydantic import ValidationError

from peer.coordinator.client import CoordinatorClient
from peer.coordinator.connection import check_token
from peer.coordinator.exceptions import (
    CoordinatorError,
    CoordinatorFailed,
    CoordinatorUnreachable,
    NotACoordinator,
    RateLimited,
    RunNotAccepting,
    Unauthorized,
)
from peer.coordinator.reports import ReportFields, ReportQueue, clean_report
from peer.formats.payloads import RendezvousPeer

logger = logging.getLogger("peer.coordinator")

# Errors that say nothing about the request, only that the coordinator is not there (or
# not itself) right now: retry the same thing later.
_AWAY = (CoordinatorUnreachable, NotACoordinator, CoordinatorFailed)
_REPORT_BATCH = 32
# At most this long (and never past ``request_timeout``) saying goodbye at close().
LEAVE_TIMEOUT_S = 2.0


@dataclass(frozen=True, slots=True)
class SessionTimings:
    """Seconds. ``retry_base`` is the first back-off after a failure; ``request_timeout``
    bounds each call the session makes (so :meth:`CoordinatorSession.close` is prompt)."""

    poll_interval: float = 3.0
    rendezvous_interval: float = 10.0
    retry_base: float = 1.0
    max_backoff: float = 30.0
    request_timeout: float = 5.0

    def __post_init__(self) -> None:
        if (
            not 0 < self.retry_base <= self.max_backoff
            or min(self.poll_interval, self.rendezvous_interval) <= 0
        ):
            raise ValueError("need poll_interval > 0 and 0 < retry_base <= max_backoff")
        if self.request_timeout <= 0:
            raise ValueError("request_timeout must be > 0")


class _Backoff:
    """When to try again after ``failures`` failures in a row."""

    def __init__(self, base: float, cap: float, rng: random.Random) -> None:
        self.base, self.cap, self.rng = base, cap, rng
        self.failures = 0

    def failed(self) -> float:
        self.failures += 1
        delay = min(self.cap, self.base * 2.0 ** (self.failures - 1))
        return delay * self.rng.uniform(0.8, 1.2)

    def reset(self) -> None:
        self.failures = 0


class CoordinatorSession:
    """Talks to the coordinator for a joined peer until :meth:`close`.

    - renews the certificate when a third of its lifetime remains and hands the new one to
      ``on_certificate(certificate_base64, expires_at)`` (e.g. ``node.set_auth``);
    - sends what :meth:`submit_report` queued, oldest first;
    - polls the run's status: :attr:`status`, and ``on_status(status)`` when it changes;
      when the run's revocation list has a new serial, fetches it and hands its bytes to
      ``on_revocations(data)`` (e.g. ``node.revoke``), until that call succeeds;
    - when ``needs_bootstrap()`` is true (the node has no peer left), asks for bootstrap
      addresses and hands them to ``on_bootstrap(addresses)`` (e.g.
      ``node.add_initial_peers``);
    - every ``rendezvous_interval``, given ``on_rendezvous``, asks which peers behind NATs
      punch and hands them to ``on_rendezvous(peers)`` (e.g. ``node.introduce``);
    - when the coordinator refuses the peer token (401: it expired after the peer was away
      longer than the coordinator's ``PEER_TOKEN_TTL_S``, or it was revoked by a ban or a
      newer join), stops renewing, sets :attr:`credentials_lost` to one line for the
      volunteer (join again with an invite) and calls ``on_credentials_lost(line)``.

    Callbacks run on the session's thread; what they raise is logged, never propagated.
    ``status`` is the run's status as last known (e.g. from the join answer), if any.
    """

    def __init__(
        self,
        client: CoordinatorClient,
        *,
        run_id: str,
        peer_token: str,
        certificate_expires_at: float,
        on_certificate: Callable[[str, float], object] | None = None,
        on_status: Callable[[str], object] | None = None,
        on_revocations: Callable[[bytes], object] | None = None,
        needs_bootstrap: Callable[[], bool] | None = None,
        on_bootstrap: Callable[[list[str]], object] | None = None,
        on_rendezvous: Callable[[list[RendezvousPeer]], object] | None = None,
        on_credentials_lost: Callable[[str], object] | None = None,
        status: str | None = None,
        max_reports: int = 256,
        timings: SessionTimings | None = None,
        seed: int | None = None,
    ) -> None:
        if not isinstance(run_id, str) or not run_id:
            raise ValueError("run_id must be a non-empty string")
        self._client = client
        self._run_id = run_id
        self._token = check_token(peer_token)
        self._on_certificate = on_certificate
        self._on_status = on_status
        self._on_revocations = on_revocations
        self._revocations_serial = 0  # the newest list handed on (0: there are no bans)
        self._needs_bootstrap = needs_bootstrap
        self._on_bootstrap = on_bootstrap
        self._on_rendezvous = on_rendezvous
        self._on_credentials_lost = on_credentials_lost
        self._credentials_lost: str | None = None
        self.timings = timings or SessionTimings()
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._closing = threading.Event()
        self._flush_deadline = 0.0
        self._queue = ReportQueue(max_reports)
        self._status = status
        self._status_detail: str | None = None
        self._reachable = True
        self._piling_noted = False
        self._refused: set[type[CoordinatorError]] = set()  # report errors logged once

        t = self.timings
        rng = random.Random(seed)
        self._renew_backoff = _Backoff(t.retry_base, t.max_backoff, rng)
        self._poll_backoff = _Backoff(t.poll_interval, t.max_backoff, rng)
        self._report_backoff = _Backoff(t.retry_base, t.max_backoff, rng)
        self._bootstrap_backoff = _Backoff(t.poll_interval, t.max_backoff, rng)
        self._renew_warned = False
        now = time.monotonic()
        self._certificate_expires_at = 0.0
        self._renew_at = now
        self._set_certificate(certificate_expires_at)
        self._poll_at = now
        self._poll_hinted = False  # poll_soon() asked for a poll before the next one is due
        self._hint_at = -math.inf  # when poll_soon() was last honoured
        self._report_at = now
        self._bootstrap_at = now + t.poll_interval  # the join answer brought addresses
        self._rendezvous_at = now

        self._thread = threading.Thread(
            target=self._run, name=f"swarmgrad-coordinator-{run_id[:8]}", daemon=True
        )
        self._thread.start()

    # ------------------------------------------------------------------ public

    @property
    def status(self) -> str | None:
        """The run's status as last seen ("running", "paused", "finished"), or None."""
        with self._lock:
            return self._status

    @property
    def status_detail(self) -> str | None:
        """Why the run is in its status, as the coordinator last said ("waiting for 3
        volunteers (1 online)", "reached its last epoch 40"), or None."""
        with self._lock:
            return self._status_detail

    @property
    def coordinator_reachable(self) -> bool:
        """False since a call found the coordinator away, until one succeeds again."""
        with self._lock:
            return self._reachable

    @property
    def pending_reports(self) -> int:
        """Reports not yet taken by the coordinator."""
        with self._lock:
            return len(self._queue)

    @property
    def credentials_lost(self) -> str | None:
        """Why the coordinator no longer accepts this peer's token, as one line telling the
        volunteer to join again with an invite; None while it does."""
        with self._lock:
            return self._credentials_lost

    @property
    def certificate_expires_at(self) -> float:
        """Unix time at which the newest certificate expires."""
        with self._lock:
            return self._certificate_expires_at

    def submit_report(self, fields: ReportFields) -> None:
        """Queue a progress report (the fields of :class:`~peer.formats.requests.ReportCreate`)
        and return at once; it is sent in the background. Never blocks on the coordinator and
        never raises because of it (``TypeError`` only for a ``fields`` that is not a
        mapping). Values the coordinator would refuse are cleaned first
        (:func:`~peer.coordinator.reports.clean_report`); a report still invalid is dropped
        with a warning, as the coordinator would refuse it."""
        try:
            report = clean_report(fields)
        except ValueError as exc:
            logger.warning("a progress report is invalid (%s); dropped", _invalid(exc))
            return
        with self._lock:
            if self._closing.is_set():
                logger.debug("a progress report after close() was dropped")
                return
            merges = self._queue.merges
            self._queue.add(report)
            if self._queue.merges != merges and not self._piling_noted:
                self._piling_noted = True
                logger.info(
                    "%d progress reports wait for the coordinator; merging the oldest "
                    "(their totals are kept)",
                    len(self._queue),
                )
        self._wake.set()

    def poll_soon(self) -> None:
        """Read the run's status now rather than at the next regular poll: a hint that it
        may have changed (a paused peer sees the others train, so the organizer most likely
        resumed the run). Hints come from peers' claims, so at most one is honoured per poll
        interval: whatever the swarm says, the coordinator is asked at most twice as often."""
        with self._lock:
            now = time.monotonic()
            if now - self._hint_at < self.timings.poll_interval:
                return
            self._hint_at, self._poll_hinted = now, True
        self._wake.set()

    def _take_poll_hint(self) -> bool:
        with self._lock:
            hinted, self._poll_hinted = self._poll_hinted, False
        return hinted

    def close(self, flush_timeout: float = 2.0) -> None:
        """Send what is queued (for at most ``flush_timeout`` seconds), tell the coordinator
        this peer leaves (for at most :data:`LEAVE_TIMEOUT_S`; a failure is only logged), then
        stop the thread. Reports still unsent are counted in a log line. Idempotent."""
        if not self._closing.is_set():
            with self._lock:
                self._flush_deadline = time.monotonic() + max(0.0, flush_timeout)
                self._closing.set()
        self._wake.set()
        if self._thread is not threading.current_thread():
            self._thread.join(
                max(0.0, flush_timeout) + self.timings.request_timeout + self._leave_timeout() + 1.0
            )
            if self._thread.is_alive():
                logger.warning("the coordinator session's thread did not stop in time")

    def __enter__(self) -> CoordinatorSession:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # ------------------------------------------------------------------ the thread

    def _run(self) -> None:
        while not self._closing.is_set():
            now = time.monotonic()
            self._guarded(self._send_reports, now, "_report_at")
            if now >= self._renew_at:
                self._guarded(self._renew, now, "_renew_at")
            if now >= self._poll_at or self._take_poll_hint():
                self._guarded(self._poll_status, now, "_poll_at")
            if self._needs_bootstrap is not None and now >= self._bootstrap_at:
                self._guarded(self._bootstrap, now, "_bootstrap_at")
            if self._on_rendezvous is not None and now >= self._rendezvous_at:
                self._guarded(self._rendezvous, now, "_rendezvous_at")
            due = [self._renew_at, self._poll_at]
            if self._needs_bootstrap is not None:
                due.append(self._bootstrap_at)
            if self._on_rendezvous is not None:
                due.append(self._rendezvous_at)
            if self.pending_reports:
                due.append(self._report_at)
            self._wake.wait(max(0.0, min(due) - time.monotonic()))
            self._wake.clear()
        self._guarded(self._final_flush, time.monotonic())
        self._guarded(self._leave, time.monotonic())

    def _guarded(self, step: Callable[[float], None], now: float, due: str | None = None) -> None:
        # The thread must outlive any bug in a callback or a surprise from below, without
        # retrying the failed step in a tight loop.
        try:
            step(now)
        except Exception:
            logger.exception("coordinator session: %s failed", step.__name__.strip("_"))
            if due is not None and getattr(self, due) <= now:
                setattr(self, due, time.monotonic() + self.timings.max_backoff)

    def _away(self, exc: CoordinatorError) -> None:
        with self._lock:
            was, self._reachable = self._reachable, False
        if was:
            logger.warning(
                "%s; training goes on, progress reports wait until it answers", _sentence(exc)
            )

    def _back(self, now: float) -> None:
        with self._lock:
            was, self._reachable = self._reachable, True
            self._piling_noted = False
            pending = len(self._queue)
        if not was:
            logger.info(
                "the coordinator answers again; sending %d waiting progress report(s)", pending
            )
            # everything that was backing off may go now
            self._report_backoff.reset()
            self._report_at = now
            self._poll_backoff.reset()
            self._poll_at = min(self._poll_at, now + self.timings.poll_interval)
            if self._renew_backoff.failures:
                self._renew_at = now

    # reports ---------------------------------------------------------------------------------

    def _send_reports(self, now: float, deadline: float | None = None) -> None:
        if now < self._report_at and deadline is None:
            return
        while True:
            with self._lock:
                batch = self._queue.peek_batch(_REPORT_BATCH)
            if not batch:
                return
            for report in batch:
                timeout = self.timings.request_timeout
                if deadline is not None:
                    timeout = min(timeout, deadline - time.monotonic())
                    if timeout <= 0:
                        return
                try:
                    self._client.report(self._token, self._run_id, report, timeout=timeout)
                except RateLimited as exc:
                    self._report_at = time.monotonic() + exc.retry_after
                    return
                except _AWAY as exc:
                    self._away(exc)
                    self._report_at = time.monotonic() + self._report_backoff.failed()
                    return
                except CoordinatorError as exc:
                    self._refused_report(exc)
                else:
                    self._report_backoff.reset()
                    self._back(time.monotonic())
                with self._lock:
                    self._queue.ack(1)
                if self._closing.is_set() and deadline is None:
                    return  # the final flush takes over, with its deadline

    def _refused_report(self, exc: CoordinatorError) -> None:
        """The coordinator took the report and said no: sending it again would not help."""
        self._back(time.monotonic())
        if isinstance(exc, Unauthorized):
            self._token_refused(exc)
            return
        if isinstance(exc, RunNotAccepting):
            self._poll_at = time.monotonic()  # the run finished, most likely: see its status
        kind = type(exc)
        if kind not in self._refused:
            self._refused.add(kind)
            logger.warning("the coordinator refused a progress report: %s", exc)

    def _final_flush(self, now: float) -> None:
        with self._lock:
            deadline = self._flush_deadline
        self._send_reports(now, deadline)
        left = self.pending_reports
        if left:
            logger.warning(
                "%d progress report(s) not sent: the coordinator did not take them in time", left
            )

    def _leave_timeout(self) -> float:
        return min(LEAVE_TIMEOUT_S, self.timings.request_timeout)

    def _leave(self, now: float) -> None:
        """Say goodbye once, so that the dashboards show this peer offline at once rather
        than after the presence window. Not with a token the coordinator refused."""
        if self.credentials_lost is not None:
            return
        try:
            self._client.leave(self._token, self._run_id, timeout=self._leave_timeout())
        except CoordinatorError as exc:
            logger.info(
                "could not tell the coordinator this peer leaves (%s); it shows offline "
                "once its silence outlasts the presence window",
                exc,
            )
        else:
            logger.debug("told the coordinator this peer leaves")

    # certificate -----------------------------------------------------------------------------

    def _set_certificate(self, expires_at: float) -> None:
        """Plan the renewal of a certificate valid until ``expires_at`` (Unix time): when a
        third of its lifetime, as counted from now, remains."""
        remaining = float(expires_at) - time.time()
        with self._lock:
            self._certificate_expires_at = float(expires_at)
        self._renew_at = time.monotonic() + max(0.0, remaining * 2.0 / 3.0)

    def _token_refused(self, exc: Unauthorized) -> None:
        """The peer token is no longer accepted: nothing this session sends can succeed."""
        line = (
            f"the coordinator no longer accepts this peer's token ({exc}); ask the organizer "
            f"for an invite and join again: swarmgrad join {self._client.url} --token INVITE"
        )
        with self._lock:
            if self._credentials_lost is not None:
                return
            self._credentials_lost = line
        self._renew_at = math.inf
        logger.warning("%s", line)
        if self._on_credentials_lost is not None:
            self._on_credentials_lost(line)

    def _renew(self, now: float) -> None:
        try:
            certificate, expires_at = self._client.renew_certificate(self._token, self._run_id)
        except Unauthorized as exc:
            self._back(time.monotonic())
            self._token_refused(exc)
            return
        except CoordinatorError as exc:
            if isinstance(exc, _AWAY):
                self._away(exc)
            delay = exc.retry_after if isinstance(exc, RateLimited) else 0.0
            self._renew_at = time.monotonic() + max(delay, self._renew_backoff.failed())
            if not self._renew_warned:
                self._renew_warned = True
                logger.warning(
                    "cannot renew the run certificate (%s); live links continue until %s, "
                    "when it expires; will keep trying",
                    exc,
                    _clock_time(self.certificate_expires_at),
                )
            return
        self._back(time.monotonic())
        self._renew_backoff.reset()
        if self._renew_warned:
            self._renew_warned = False
            logger.info("renewed the run certificate; valid until %s", _clock_time(expires_at))
        self._set_certificate(expires_at)
        if self._on_certificate is not None:
            self._on_certificate(certificate, expires_at)

    # status ----------------------------------------------------------------------------------

    def _poll_status(self, now: float) -> None:
        try:
            run = self._client.run(self._run_id)
        except CoordinatorError as exc:
            if isinstance(exc, _AWAY):
                self._away(exc)
                self._poll_at = time.monotonic() + self._poll_backoff.failed()
            else:
                logger.debug("cannot read the run's status: %s", exc)
                self._poll_at = time.monotonic() + self.timings.poll_interval
            return
        self._back(time.monotonic())
        self._poll_backoff.reset()
        self._poll_at = time.monotonic() + self.timings.poll_interval
        status = run.status.value
        with self._lock:
            changed, self._status = status != self._status, status
            self._status_detail = run.status_detail
        if changed:
            logger.info("the run is %s", status)
            if self._on_status is not None:
                self._on_status(status)
        serial = run.revocations_serial
        if (
            self._on_revocations is not None
            and serial is not None
            and serial > self._revocations_serial
        ):
            self._fetch_revocations(serial)

    def _fetch_revocations(self, serial: int) -> None:
        assert self._on_revocations is not None
        try:
            data = self._client.revocations(self._run_id)
        except CoordinatorError as exc:
            logger.info("cannot read the run's revocation list yet: %s", exc)
            return
        self._on_revocations(data)  # what it raises is logged by _guarded; asked again then
        self._revocations_serial = serial
        logger.info("the run's revocation list %d is in force", serial)

    # bootstrap -------------------------------------------------------------------------------

    def _bootstrap(self, now: float) -> None:
        assert self._needs_bootstrap is not None
        self._bootstrap_at = now + self.timings.poll_interval
        if not self._needs_bootstrap():
            self._bootstrap_backoff.reset()
            return
        # Asked again after a growing pause while the node stays alone (a lone volunteer
        # is alone for good until someone else joins).
        self._bootstrap_at = now + self._bootstrap_backoff.failed()
        try:
            addresses = self._client.bootstrap(self._token, self._run_id)
        except CoordinatorError as exc:
            self._bootstrap_at = max(self._bootstrap_at, self._failed(exc, now, "bootstrap peers"))
            return
        self._back(time.monotonic())
        if addresses:
            logger.info("no peer left; trying %d address(es) from the coordinator", len(addresses))
            if self._on_bootstrap is not None:
                self._on_bootstrap(addresses)

    def _failed(self, exc: CoordinatorError, now: float, what: str) -> float:
        """What a periodic call's failure means for the session: the token refused, the
        coordinator away, or a rate limit, whose end it returns (else ``now``): the
        earliest time to ask again."""
        if isinstance(exc, Unauthorized):
            self._token_refused(exc)
        elif isinstance(exc, _AWAY):
            self._away(exc)
        elif isinstance(exc, RateLimited):
            return now + exc.retry_after
        else:
            logger.debug("cannot get %s: %s", what, exc)
        return now

    def _rendezvous(self, now: float) -> None:
        assert self._on_rendezvous is not None
        self._rendezvous_at = now + self.timings.rendezvous_interval
        try:
            peers = self._client.rendezvous(self._token, self._run_id)
        except CoordinatorError as exc:
            failed = self._failed(exc, now, "the rendezvous list")
            self._rendezvous_at = max(self._rendezvous_at, failed)
            return
        self._back(time.monotonic())
        self._on_rendezvous(peers)


def _clock_time(unix: float) -> str:
    return time.strftime("%H:%M", time.localtime(unix))


def _invalid(exc: ValueError) -> str:
    """A refused report's fields and why, on one line."""
    if isinstance(exc, ValidationError):
        return "; ".join(
            f"{'.'.join(str(part) for part in error['loc']) or 'report'}: {error['msg']}"
            for error in exc.errors()
        )
    return str(exc)


def _sentence(exc: CoordinatorError) -> str:
    text = str(exc)
    return (
        text
        if isinstance(exc, CoordinatorUnreachable | NotACoordinator)
        else (f"the coordinator failed ({text})")
    )
