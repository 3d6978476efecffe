"""Plausibility bounds on progress reports: pure rules, no I/O, no clock.

A report is refused (422) when it claims what no honest peer can:

* ``samples_per_second`` above the coordinator's limit (``report_max_samples_per_second``);
* a samples counter that outruns that limit: everything a peer has contributed (the counts
  banked at its counter resets plus its current counter) may not exceed the limit times the
  time since the peer first joined, plus a grace of :data:`SAMPLES_GRACE_S` seconds at the
  limit (clock differences between workers, counting that began just before the join). A
  reset is allowed, but it banks only the previous counter, which was itself within the
  bound — so no sequence of resets can add more than the limit allows;
* an epoch more than ``report_max_epoch_lead`` past the swarm's epoch (:func:`swarm_epoch`).

Why a lifetime bound rather than one between consecutive reports: peers queue reports while
the coordinator is unreachable and send them in a burst when it returns, so the time between
two arrivals says nothing about the work between them; the time since joining does.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from server.schemas import MAX_INT

# Seconds of work at the limit a peer may claim beyond the time since it joined.
SAMPLES_GRACE_S = 60.0


class Bound(enum.StrEnum):
    """Which bound a refused report broke (stored per peer as its last refusal)."""

    samples_per_second = "samples_per_second"
    samples = "samples"
    epoch = "epoch"


@dataclass(frozen=True, slots=True)
class Refusal:
    bound: Bound
    detail: str


@dataclass(frozen=True, slots=True)
class ReportLimits:
    max_samples_per_second: float
    max_epoch_lead: int

    def samples_cap(self, first_seen_ms: int, now_ms: int) -> int:
        """The most a peer that joined at ``first_seen_ms`` can have contributed by ``now_ms``."""
        elapsed_s = max(0, now_ms - first_seen_ms) / 1000 + SAMPLES_GRACE_S
        return min(MAX_INT, int(self.max_samples_per_second * elapsed_s))


@dataclass(frozen=True, slots=True)
class PeerTrack:
    """What the bounds need to know about one peer: when it joined, whose it is, and its
    counter as of its latest accepted report (``as_of_ms``; None before any)."""

    first_seen_ms: int
    volunteer_id: int
    banked: int
    samples: int
    as_of_ms: int | None

    def contribution_after(self, samples: int) -> int:
        """The peer's total if its counter now reads ``samples`` (a lower reading is a reset:
        the previous counter is banked)."""
        return self.banked + (self.samples if samples < self.samples else 0) + samples

    def after(self, samples: int, at_ms: int) -> PeerTrack:
        banked = self.banked + (self.samples if samples < self.samples else 0)
        return PeerTrack(self.first_seen_ms, self.volunteer_id, banked, samples, at_ms)


@dataclass(slots=True)
class SwarmView:
    """The run's epochs as one worker knows them: read from the database at ``read_ms`` —
    the highest epoch of each volunteer with a peer online (``online``) and the highest any
    peer of the run ever reported (``highest``) — then raised in ``online`` by the reports
    the worker admits (:meth:`saw`), so that the swarm's progress counts before it is
    written."""

    read_ms: int
    online: dict[int, int]
    highest: int
    # What :meth:`saw` added: volunteer -> (epoch, when), carried into the next view until
    # the database has it or it is older than the online TTL.
    admitted: dict[int, tuple[int, int]] = field(default_factory=dict)

    def saw(self, volunteer_id: int, epoch: int, at_ms: int) -> None:
        if epoch > self.online.get(volunteer_id, -1):
            self.online[volunteer_id] = epoch
        if epoch >= self.admitted.get(volunteer_id, (-1, 0))[0]:
            self.admitted[volunteer_id] = (epoch, at_ms)

    def carry(self, older: SwarmView, since_ms: int) -> None:
        """Keep what ``older`` admitted since ``since_ms`` (it may not be written yet)."""
        for volunteer_id, (epoch, at_ms) in older.admitted.items():
            if at_ms >= since_ms:
                self.saw(volunteer_id, epoch, at_ms)


def swarm_epoch(view: SwarmView, volunteer_id: int) -> int:
    """The swarm's epoch as the bound sees it for a report of ``volunteer_id``: never raised
    by that volunteer's own reports since the view was read.

    With at least two other volunteers online, the highest of *their* epochs: one volunteer
    cannot climb step by step, and one stuck far behind cannot hold the others back. With
    fewer there is no majority to tell a liar from a laggard, so the highest epoch the run
    had reached when the view was read counts as well (the reporter's own included): a lone
    volunteer can then move the epoch by at most the lead per refresh of the view.
    """
    others = [epoch for v, epoch in view.online.items() if v != volunteer_id]
    if len(others) >= 2:
        return max(others)
    return max([view.highest, *others])


def check(
    limits: ReportLimits,
    track: PeerTrack,
    view: SwarmView | None,
    *,
    epoch: int,
    samples: int,
    samples_per_second: float,
    now_ms: int,
) -> Refusal | None:
    """The first bound the report breaks, or None. Without a view of the swarm (the
    database never answered) the epoch is not judged."""
    if samples_per_second > limits.max_samples_per_second:
        return Refusal(
            Bound.samples_per_second,
            f"samples_per_second {samples_per_second:g} is over this coordinator's limit "
            f"of {limits.max_samples_per_second:g}",
        )
    cap = limits.samples_cap(track.first_seen_ms, now_ms)
    if track.contribution_after(samples) > cap:
        return Refusal(
            Bound.samples,
            f"samples {samples} would bring this peer's total over {cap}, the most "
            f"{limits.max_samples_per_second:g} samples/s allows since it joined",
        )
    if view is not None:
        allowed = swarm_epoch(view, track.volunteer_id) + limits.max_epoch_lead
        if epoch > allowed:
            return Refusal(
                Bound.epoch,
                f"epoch {epoch} is more than {limits.max_epoch_lead} past the swarm's "
                f"epoch (at most {allowed} is accepted)",
            )
    return None
