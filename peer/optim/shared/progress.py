"""Swarm progress: what each peer reports, and the swarm's epoch computed from the reports.

Every training loop counts epochs across the swarm the same way; only the unit differs
(steps for :class:`peer.DecentralizedOptimizer`, samples for :class:`peer.Optimizer`). Each
peer stores one record under :func:`progress_key`, with its peer id as the subkey (gossip
records are signed by their owner, so no peer overwrites another's)::

    [epoch, done_at_epoch, done_in_total, time, samples_per_second, client_mode]

:func:`compute_swarm_progress` is the pure rule (reports in, :class:`SwarmProgress` out);
:class:`ProgressTracker` publishes this peer's reports and reads the others' from the
node's replica of the gossip store.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import TypeGuard

from peer.exceptions import SwarmgradError
from peer.formats.identity import is_peer_id
from peer.optim.seam import SwarmNode

logger = logging.getLogger("peer.optim.progress")

__all__ = [
    "PerformanceEMA",
    "ProgressReport",
    "ProgressTracker",
    "ProgressWatch",
    "SwarmCounter",
    "SwarmProgress",
    "compute_swarm_progress",
    "progress_key",
]


def progress_key(prefix: str) -> str:
    return f"{prefix}.progress"


def _is_count(value: object) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _is_finite(value: object) -> TypeGuard[int | float]:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


@dataclass(frozen=True)
class ProgressReport:
    """One peer's progress: ``done_at_epoch`` steps or samples since it entered ``epoch``;
    ``done_in_total`` samples since it started (steps for
    :class:`peer.DecentralizedOptimizer`, which counts no samples)."""

    peer_id: str
    epoch: int
    done_at_epoch: int
    done_in_total: int
    time: float
    samples_per_second: float = 0.0
    client_mode: bool = False

    def to_wire(self) -> list[int | float | bool]:
        return [
            self.epoch,
            self.done_at_epoch,
            self.done_in_total,
            self.time,
            self.samples_per_second,
            self.client_mode,
        ]

    @classmethod
    def from_wire(cls, peer_id: str, value: object) -> ProgressReport | None:
        """Parse a gossip value; None for anything malformed (a buggy or hostile peer's
        record is ignored rather than allowed to break every other peer's step)."""
        if not isinstance(value, list | tuple) or len(value) != 6:
            return None
        epoch, done, total, when, sps, client = value
        if not (_is_count(epoch) and _is_count(done) and _is_count(total)):
            return None
        if not (_is_finite(when) and _is_finite(sps)) or sps < 0 or not isinstance(client, bool):
            return None
        return cls(peer_id, epoch, done, total, float(when), float(sps), client)


@dataclass(frozen=True)
class SwarmProgress:
    """The swarm as seen from one peer (see the module docstring for the epoch rule)."""

    epoch: int  # the largest epoch a live peer reports (this one included; see the rule)
    done_at_epoch: int  # steps or samples reported at ``epoch``, summed over peers
    target: int  # how many make an epoch
    num_peers: int  # peers with a live report, this one included
    num_peers_at_epoch: int
    num_clients_at_epoch: int  # of those, peers in client mode
    samples_per_second: float  # summed over peers
    local_epoch: int

    @property
    def ready(self) -> bool:
        """True when ``epoch`` is complete: the next step belongs to ``epoch + 1``."""
        return self.done_at_epoch >= self.target

    @property
    def seconds_left(self) -> float:
        """When samples are counted: the time the rest of ``epoch`` takes at the swarm's
        current speed (0 when complete, inf when nobody reports a speed)."""
        missing = max(self.target - self.done_at_epoch, 0)
        if not missing:
            return 0.0
        return missing / self.samples_per_second if self.samples_per_second > 0 else math.inf

    @property
    def epochs_behind(self) -> int:
        """How many epochs this peer lags the swarm's latest one (0 if it is at it)."""
        return max(0, self.epoch - self.local_epoch)

    @property
    def target_epoch(self) -> int:
        """The epoch this peer's next step belongs to."""
        return self.epoch + 1 if self.ready else self.epoch


def compute_swarm_progress(
    reports: Iterable[ProgressReport],
    local: ProgressReport,
    target: int,
    ignore: Mapping[str, int] | None = None,
) -> SwarmProgress:
    """The swarm's state from the peers' reports and this peer's own fresh one.

    ``local`` replaces any report carrying the same peer id (gossip may still hold an older
    one). The swarm's epoch is the largest epoch any report gives, leaving out a report of a
    peer in ``ignore`` at or past the epoch given there: a claim this peer found nobody
    could back is *discounted* (:meth:`ProgressTracker.discount`) for a while, so a peer
    claiming an epoch far ahead costs the others one download attempt rather than their
    training. The epoch is complete when what was done *at that epoch*, summed over peers,
    reaches ``target``; work reported at older epochs does not count (its peer has not
    noticed the advance yet). Gossip lag lets the swarm overshoot an epoch a little; nothing
    depends on the count being exact. Pure: no clock, no I/O.
    """
    if target < 1:
        raise ValueError("an epoch's target must be at least 1")
    ignore = ignore or {}
    by_peer = {r.peer_id: r for r in reports if r.epoch < ignore.get(r.peer_id, r.epoch + 1)}
    by_peer[local.peer_id] = local
    epoch = max(r.epoch for r in by_peer.values())
    at_epoch = [r for r in by_peer.values() if r.epoch == epoch]
    return SwarmProgress(
        epoch=epoch,
        done_at_epoch=sum(r.done_at_epoch for r in at_epoch),
        target=target,
        num_peers=len(by_peer),
        num_peers_at_epoch=len(at_epoch),
        num_clients_at_epoch=sum(r.client_mode for r in at_epoch),
        samples_per_second=sum(r.samples_per_second for r in by_peer.values()),
        local_epoch=local.epoch,
    )


class SwarmCounter:
    """The swarm's samples counter as one peer sees it in the progress records: the growth of
    each peer's ``done_in_total`` since this peer first saw it, summed over peers. A count
    that fell is a peer that started again: all of its new count is growth. A peer whose
    record is gone is forgotten (seen again, it starts from its count then). Fed to a
    :class:`~peer.formats.rates.CountedRate` on the observer's clock, it gives the swarm's
    samples/s the way the coordinator counts a run's: counted, not the sum of the claimed
    ``samples_per_second``. Pure: no clock, no I/O."""

    def __init__(self) -> None:
        self.total = 0
        self._seen: dict[str, int] = {}

    def observe(self, reports: Iterable[ProgressReport]) -> int:
        """Take the peers' current records in; the counter now."""
        seen: dict[str, int] = {}
        for report in reports:
            count = report.done_in_total
            before = self._seen.get(report.peer_id)
            if before is not None:
                self.total += count - before if count >= before else count
            seen[report.peer_id] = count
        self._seen = seen
        return self.total


class PerformanceEMA:
    """Samples per second, as an exponential moving average over steps.

    ``update(samples)`` after each step; the interval is measured from the previous update
    (the first update only starts the clock). ``pause()`` before a gap that is not training
    (a state download) so it is not counted as slowness.
    """

    def __init__(self, alpha: float = 0.1, clock: Callable[[], float] = time.perf_counter) -> None:
        if not 0.0 < alpha <= 1.0:
            raise ValueError("alpha must be in (0, 1]")
        self.alpha = alpha
        self.clock = clock
        self.samples_per_second = 0.0
        self._last: float | None = None
        self._seen = 0

    def update(self, samples: int) -> float:
        now = self.clock()
        if self._last is not None:
            interval = max(now - self._last, 1e-9)
            rate = samples / interval
            self._seen += 1
            # plain mean for the first few intervals, so one odd step does not stick
            alpha = max(self.alpha, 1.0 / self._seen)
            self.samples_per_second += alpha * (rate - self.samples_per_second)
        self._last = now
        return self.samples_per_second

    def pause(self) -> None:
        self._last = None


class ProgressTracker:
    """Publish this peer's :class:`ProgressReport` and read the swarm's.

    :meth:`report` never blocks on the network: it leaves the report in a one-slot mailbox
    that a task on the node's event loop stores (a newer report overwrites one that was not
    stored yet, so a fast loop does not queue stores). Within one epoch, stores are at least
    ``refresh_interval`` apart; the latest report is always stored in the end, and a report
    of a new epoch goes out at once; a record expires ``expiration`` seconds after its
    ``time``, so a peer that stops reporting drops out of the count on its own.
    :meth:`fetch` reads the node's local replica of the gossip store. Thread-safe. Call :meth:`shutdown` when done: it retracts this peer's
    report so the swarm stops counting it at once rather than when it expires.
    """

    #: seconds between two reads of the store, and between two stores of reports of one
    #: epoch. Gossip spreads records every ``gossip_period`` anyway; touching the node's
    #: loop on every training step costs a thread round trip for nothing newer.
    refresh_interval: float = 0.05

    def __init__(
        self, node: SwarmNode, prefix: str, target: int, *, expiration: float = 30.0
    ) -> None:
        if expiration <= 0:
            raise ValueError("the progress reports' expiration must be positive")
        if target < 1:
            raise ValueError("an epoch's target must be at least 1")
        self.node = node
        self.key = progress_key(prefix)
        self.target = int(target)
        self.expiration = float(expiration)
        self._fetched: list[ProgressReport] = []
        self._fetched_at = -math.inf
        self._latest: ProgressReport | None = None
        self._stored: ProgressReport | None = None
        self._stored_until = 0.0
        self._stored_at = -math.inf
        self._kicked = False
        self._task: asyncio.Task[None] | None = None
        self._shut = False
        self._discounted: dict[str, tuple[int, float]] = {}  # peer -> (epoch, until)
        self._not_peer_ids: set[str] = set()  # subkeys warned about (bounded)

    @property
    def peer_id(self) -> str:
        return str(self.node.peer_id)

    def report(self, report: ProgressReport) -> None:
        """Publish ``report`` (asynchronously; see :meth:`flush`)."""
        if self._shut:
            return
        self._latest = report
        if self._kicked:
            return  # the store task is running and picks the newest report up
        self._kicked = True
        with contextlib.suppress(RuntimeError):  # the loop closed under us: nothing to do
            self.node.loop.call_soon_threadsafe(self._kick)

    def _kick(self) -> None:
        if self._shut or (self._task is not None and not self._task.done()):
            return
        self._task = asyncio.get_running_loop().create_task(self._push())

    async def _push(self) -> None:
        core = self.node.core
        while True:
            while not self._shut and self._latest is not None and self._latest is not self._stored:
                report = self._latest
                stored = self._stored
                if stored is not None and stored.epoch == report.epoch:
                    wait = self._stored_at + self.refresh_interval - time.monotonic()
                    if wait > 0:
                        await asyncio.sleep(wait)
                        continue  # a newer report may have come meanwhile
                # a store needs a strictly later expiration than our own previous record
                until = max(report.time + self.expiration, self._stored_until + 1e-6)
                try:
                    await core.store(self.key, report.to_wire(), until, subkey=core.peer_id)
                except SwarmgradError as exc:
                    logger.debug("could not store a progress report: %s", exc)
                    self._kicked = False
                    return
                self._stored, self._stored_until = report, until
                self._stored_at = time.monotonic()
            self._kicked = False
            if self._shut or self._latest is None or self._latest is self._stored:
                return
            self._kicked = True  # a report came between the last check and the reset

    def flush(self, timeout: float = 5.0) -> bool:
        """Wait until the latest report is in the local store (it spreads by gossip from
        there). Returns False if that did not happen within ``timeout``."""
        deadline = time.monotonic() + timeout
        while self._latest is not self._stored and not self._shut:
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.005)
        return True

    def fetch(self, *, fresh: bool = False) -> list[ProgressReport]:
        """Every live, well-formed report this node knows of (this peer's own included, as
        last stored); the previous answer if asked again within ``refresh_interval``,
        unless ``fresh``."""
        now = time.monotonic()
        if fresh or now - self._fetched_at >= self.refresh_interval:
            self._fetched = self._fetch()
            self._fetched_at = now
        return self._fetched

    def _fetch(self) -> list[ProgressReport]:
        found = self.node.get(self.key)
        if found is None or not isinstance(found.value, dict):
            return []
        reports = []
        for subkey, item in found.value.items():
            if not is_peer_id(subkey):
                # anyone may write under a subkey such as "0" or an upper-cased id, which
                # no peer owns: such a report must not count as one more peer (nor make
                # "0" the lowest peer id, the checkpoint's uploader)
                shown = repr(subkey)[:80]
                if shown not in self._not_peer_ids and len(self._not_peer_ids) < 64:
                    self._not_peer_ids.add(shown)
                    logger.warning(
                        "ignoring a report under %s in %r: its subkey is not a peer id",
                        shown,
                        self.key,
                    )
                continue
            report = ProgressReport.from_wire(subkey, getattr(item, "value", None))
            if report is not None:
                reports.append(report)
        return reports

    def progress(
        self, local: ProgressReport, reports: Iterable[ProgressReport] | None = None
    ) -> SwarmProgress:
        """The swarm's progress with this peer's fresh ``local`` report (over ``reports``,
        or what :meth:`fetch` returns)."""
        return compute_swarm_progress(
            self.fetch() if reports is None else reports, local, self.target, self.discounted()
        )

    def discount(self, peer_id: str, epoch: int, seconds: float) -> None:
        """For ``seconds``, leave out ``peer_id``'s reports at or past ``epoch``: it claims
        an epoch no one could back with a state (see the module docstring)."""
        self._discounted[peer_id] = (epoch, time.monotonic() + seconds)

    def discounted(self) -> dict[str, int]:
        """The peers whose claims are discounted now, and from which epoch on."""
        now = time.monotonic()
        for peer_id in [p for p, (_, until) in self._discounted.items() if until <= now]:
            del self._discounted[peer_id]
        return {peer_id: epoch for peer_id, (epoch, _) in self._discounted.items()}

    def present(self) -> list[ProgressReport]:
        """The live reports of peers that are members of the swarm now: a report outlives
        a peer that crashed or was cut off until it expires, its membership does not."""
        members = self.node.members()
        return [r for r in self.fetch() if r.peer_id in members]

    def peers_at(self, epoch: int) -> tuple[list[str], list[str]]:
        """The present peers (:meth:`present`) at ``epoch`` or later: those a round of
        ``epoch`` may meet (an epoch's report goes out only once the rounds before it ended),
        the view an optimizer places its Moshpit grid from; and those of them in client mode."""
        reports = [r for r in self.present() if r.epoch >= epoch]
        return [r.peer_id for r in reports], [r.peer_id for r in reports if r.client_mode]

    def others_reporting(self) -> int:
        """How many other peers have a live report, at any epoch."""
        return sum(r.peer_id != self.peer_id for r in self.fetch())

    def shutdown(self, timeout: float = 2.0) -> None:
        """Stop publishing and retract this peer's report. Idempotent; the node may already
        be gone."""
        if self._shut:
            return
        self._shut = True

        async def retract() -> None:
            if self._task is not None and not self._task.done():
                self._task.cancel()
                await asyncio.gather(self._task, return_exceptions=True)
            if not self._stored_until:
                return
            core = self.node.core
            await core.store(self.key, None, self._stored_until + 1e-3, subkey=core.peer_id)

        with contextlib.suppress(Exception):  # the node may already be gone: nothing to retract
            self.node.run_coroutine(retract(), wait=False).result(timeout)


class ProgressWatch:
    """Whether the other peers' progress moved since the last look (a paused peer uses it:
    when the others train, the run most likely resumed). A peer seen for the first time has
    not moved; one whose report went away is forgotten."""

    def __init__(self, peer_id: str) -> None:
        self.peer_id = peer_id
        self._seen: dict[str, tuple[int, int]] = {}  # peer → (epoch, samples in total)

    def moved(self, reports: Iterable[ProgressReport]) -> bool:
        seen: dict[str, tuple[int, int]] = {}
        moved = False
        for report in reports:
            if report.peer_id == self.peer_id:
                continue
            now = (report.epoch, report.done_in_total)
            before = self._seen.get(report.peer_id)
            moved |= before is not None and now > before
            seen[report.peer_id] = now
        self._seen = seen
        return moved
