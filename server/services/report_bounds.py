"""Plausibility bounds on progress reports: pure rules, no I/O, no clock.

:func:`check` refuses a report (422) that claims what no honest peer can:

* ``samples_per_second`` above ``report_max_samples_per_second``;
* a samples counter (plus what its resets banked) past that limit times the time since the
  peer joined, or grown since its previous report by more than the limit allows in that
  time, each plus :data:`SAMPLES_GRACE_S` (bursts of reports queued during an outage);
* more averaging rounds than :data:`MAX_ROUNDS_PER_SECOND` allows, plus :data:`ROUNDS_GRACE`
  per report;
* a loss or metric past :data:`~peer.formats.requests.MAX_ABS_LOSS`; a group larger than the
  run's peers or :data:`MAX_GROUP_SIZE`;
* an epoch more than ``report_max_epoch_lead`` past the swarm's (:func:`swarm_epoch`);
  :func:`lift_on_refusal` keeps that bound from locking an honest swarm out for good.

So every counter a report adds is bounded by the coordinator's clock, and no sum overflows.
"""

from __future__ import annotations

import enum
import heapq
from dataclasses import dataclass, field

from peer.formats.requests import MAX_ABS_LOSS
from server.schemas import MAX_INT

# Seconds of work at the limit a peer may claim beyond the time since it joined.
SAMPLES_GRACE_S = 60.0
# Averaging rounds per second no peer completes (a round is a network exchange with a group),
# and the rounds any one report may carry beyond that.
MAX_ROUNDS_PER_SECOND = 50.0
ROUNDS_GRACE = 100
# No averaging group is larger, however many peers a run has.
MAX_GROUP_SIZE = 4096


class Bound(enum.StrEnum):
    """Which bound a refused report broke (stored per peer as its last refusal)."""

    samples_per_second = "samples_per_second"
    samples = "samples"
    rounds = "rounds"
    loss = "loss"
    eval_metric = "eval_metric"
    group_size = "group_size"
    epoch = "epoch"


@dataclass(frozen=True, slots=True)
class Refusal:
    bound: Bound
    detail: str


@dataclass(frozen=True, slots=True)
class ReportLimits:
    max_samples_per_second: float
    max_epoch_lead: int
    max_rounds_per_second: float = MAX_ROUNDS_PER_SECOND

    def samples_cap(self, first_seen_ms: int, now_ms: int) -> int:
        """The most a peer that joined at ``first_seen_ms`` can have contributed by ``now_ms``."""
        elapsed_s = max(0, now_ms - first_seen_ms) / 1000 + SAMPLES_GRACE_S
        return min(MAX_INT, int(self.max_samples_per_second * elapsed_s))

    def growth_cap(self, since_ms: int, now_ms: int) -> int:
        """The most a counter can grow between a report at ``since_ms`` and ``now_ms``."""
        return self.samples_cap(since_ms, now_ms)

    def rounds_cap(self, since_ms: int, now_ms: int) -> int:
        """The most rounds one report can carry when the previous came at ``since_ms``."""
        elapsed_s = max(0, now_ms - since_ms) / 1000
        return min(MAX_INT, int(self.max_rounds_per_second * elapsed_s) + ROUNDS_GRACE)


@dataclass(frozen=True, slots=True)
class PeerTrack:
    """What the bounds need to know about one peer: when it joined, whose it is, and its
    counter as of its latest accepted report (``as_of_ms``; None before any), and what it
    was credited in all (:mod:`server.services.credit_rates`: the counters as written)."""

    first_seen_ms: int
    volunteer_id: int
    banked: int
    samples: int
    as_of_ms: int | None
    credited: int = 0

    @property
    def previous_ms(self) -> int:
        """When the peer last reported (or joined, before its first report)."""
        return self.first_seen_ms if self.as_of_ms is None else self.as_of_ms

    def contribution_after(self, samples: int) -> int:
        """The peer's total if its counter now reads ``samples`` (a lower reading is a reset:
        the previous counter is banked)."""
        return self.banked + (self.samples if samples < self.samples else 0) + samples

    def after(self, samples: int, at_ms: int, credited: int | None = None) -> PeerTrack:
        banked = self.banked + (self.samples if samples < self.samples else 0)
        credit = self.credited if credited is None else credited
        return PeerTrack(self.first_seen_ms, self.volunteer_id, banked, samples, at_ms, credit)


@dataclass(slots=True)
class SwarmView:
    """The run's epochs as one worker knows them: read from the database at ``read_ms`` —
    the highest epoch of each volunteer with a peer online (``online``) and the highest any
    peer of the run ever reported (``highest``) — then raised in ``online`` by the reports
    the worker admits (:meth:`saw`), so that the swarm's progress counts before it is
    written, and by the epoch bounds it refused reports at (:meth:`lift`)."""

    read_ms: int
    online: dict[int, int]
    highest: int
    # The run's peers (machines that joined) when the view was read: no group is larger.
    peers: int = MAX_GROUP_SIZE
    # What :meth:`saw` added: volunteer -> (epoch, when), carried into the next view until
    # the database has it or it is older than the online TTL.
    admitted: dict[int, tuple[int, int]] = field(default_factory=dict)
    # What :meth:`lift` added, likewise (but never written, so carried until the database
    # has the volunteer that far or the entry is older than the online TTL); and who was
    # lifted in this view, at most once each.
    lifted: dict[int, tuple[int, int]] = field(default_factory=dict)
    lifted_here: set[int] = field(default_factory=set)
    # The two highest (epoch, volunteer) of ``online``: what :func:`swarm_epoch` needs,
    # kept as ``online`` rises (it never falls), so a report costs O(1), not O(volunteers).
    top: list[tuple[int, int]] = field(default_factory=list, init=False, repr=False)

    def __post_init__(self) -> None:
        self.top = heapq.nlargest(2, ((e, v) for v, e in self.online.items()))

    def _raise(self, volunteer_id: int, epoch: int) -> None:
        """``online[volunteer_id] = epoch``, above what it held."""
        self.online[volunteer_id] = epoch
        top = [t for t in self.top if t[1] != volunteer_id]
        top.append((epoch, volunteer_id))
        top.sort(reverse=True)
        self.top = top[:2]

    def saw(self, volunteer_id: int, epoch: int, at_ms: int) -> None:
        if epoch > self.online.get(volunteer_id, -1):
            self._raise(volunteer_id, epoch)
        if epoch >= self.admitted.get(volunteer_id, (-1, 0))[0]:
            self.admitted[volunteer_id] = (epoch, at_ms)

    def lift(self, volunteer_id: int, epoch: int, at_ms: int) -> bool:
        """Count ``volunteer_id`` as at ``epoch`` at least, unless it was lifted in this view
        already; whether it was. It counts at once for the other volunteers' bounds (in
        ``online``) and, once carried into the next view, as reached by the run
        (``highest``) — so, like the volunteer's own reports, never for its own bound in
        the view it was lifted in."""
        if volunteer_id in self.lifted_here:
            return False
        self.lifted_here.add(volunteer_id)
        if epoch > self.online.get(volunteer_id, -1):
            self._raise(volunteer_id, epoch)
        if epoch >= self.lifted.get(volunteer_id, (-1, 0))[0]:
            self.lifted[volunteer_id] = (epoch, at_ms)
        return True

    def carry(self, older: SwarmView, since_ms: int) -> None:
        """Keep what ``older`` admitted and lifted since ``since_ms`` (the one may not be
        written yet, the other never is). Call it on a view fresh from the database."""
        for volunteer_id, (epoch, at_ms) in older.lifted.items():
            # Once the database has the volunteer online that far, it has the run there too.
            if at_ms >= since_ms and epoch > self.online.get(volunteer_id, -1):
                self._raise(volunteer_id, epoch)
                self.highest = max(self.highest, epoch)
                self.lifted[volunteer_id] = (epoch, at_ms)
        for volunteer_id, (epoch, at_ms) in older.admitted.items():
            if at_ms >= since_ms:
                self.saw(volunteer_id, epoch, at_ms)


def swarm_epoch(view: SwarmView, volunteer_id: int) -> int:
    """The swarm's epoch as the bound sees it for a report of ``volunteer_id``: never raised
    by that volunteer's own reports since the view was read.

    With at least two other volunteers online, the highest of *their* epochs (those lifted
    by refusals included): one volunteer cannot climb step by step, nor lift itself, and
    one stuck far behind cannot hold the others back. With fewer there is no majority to
    tell a liar from a laggard, so the highest epoch the run had reached when the view was
    read counts as well (the reporter's own included, and the epochs it was lifted to in
    earlier views): a lone volunteer can then move the epoch by at most the lead per view.
    """
    others = len(view.online) - (volunteer_id in view.online)
    # ``top`` holds the two highest volunteers: at most one of them is the reporter, and
    # with fewer than two others it holds all of ``online``.
    highest_other = [epoch for epoch, v in view.top if v != volunteer_id]
    if others >= 2:
        return highest_other[0]
    return max([view.highest, *highest_other])


def lift_on_refusal(
    limits: ReportLimits, view: SwarmView, volunteer_id: int, epoch: int, at_ms: int
) -> int | None:
    """After the epoch bound refused ``volunteer_id``'s report of ``epoch``: record in
    ``view`` that the volunteer reached the bound, ``min(epoch, allowed)``, unless it was
    lifted in this view already. The epoch recorded, or None.

    So an honest swarm that ran more than the lead ahead of what the coordinator has stored
    is not locked out for good — its bound climbs by the lead per view — while a liar gains
    at most the lead per view, not per report. The recorded epoch is never written, and is
    never more than the volunteer could have reported and had accepted instead.

    With at least two other volunteers online, a volunteer's bound depends only on *their*
    epochs: one liar can neither climb step by step nor lift itself by being refused. With
    fewer, the bound rises by at most the lead per view: a lone volunteer ``n`` epochs past
    what the run has stored is accepted again at most ``ceil(n / lead) - 1`` refreshes after
    its first refusal."""
    allowed = swarm_epoch(view, volunteer_id) + limits.max_epoch_lead
    reached = min(epoch, allowed)
    return reached if view.lift(volunteer_id, reached, at_ms) else None


def check(
    limits: ReportLimits,
    track: PeerTrack,
    view: SwarmView | None,
    *,
    epoch: int,
    samples: int,
    samples_per_second: float,
    now_ms: int,
    rounds: int = 0,
    loss: float | None = None,
    eval_metric: float | None = None,
    group_size: int | None = None,
) -> Refusal | None:
    """The first bound the report breaks, or None. Without a view of the swarm (the
    database never answered) the epoch is not judged, nor the group size past the cap."""
    if samples_per_second > limits.max_samples_per_second:
        return Refusal(
            Bound.samples_per_second,
            f"samples_per_second {samples_per_second:g} is over this coordinator's limit "
            f"of {limits.max_samples_per_second:g}",
        )
    cap = limits.samples_cap(track.first_seen_ms, now_ms)
    total = track.contribution_after(samples)
    if total > cap:
        return Refusal(
            Bound.samples,
            f"samples {samples} would bring this peer's total over {cap}, the most "
            f"{limits.max_samples_per_second:g} samples/s allows since it joined",
        )
    growth = total - track.banked - track.samples
    growth_cap = limits.growth_cap(track.previous_ms, now_ms)
    if growth > growth_cap:
        return Refusal(
            Bound.samples,
            f"samples {samples} grew by {growth} since this peer's previous report, more "
            f"than {growth_cap}, the most {limits.max_samples_per_second:g} samples/s "
            "allows in that time",
        )
    rounds_cap = limits.rounds_cap(track.previous_ms, now_ms)
    if rounds > rounds_cap:
        return Refusal(
            Bound.rounds,
            f"{rounds} averaging rounds since the previous report are more than {rounds_cap}, "
            f"the most {limits.max_rounds_per_second:g} rounds/s allows in that time",
        )
    if loss is not None and abs(loss) > MAX_ABS_LOSS:
        return Refusal(Bound.loss, f"loss {loss:g} is outside ±{MAX_ABS_LOSS:g}")
    if eval_metric is not None and abs(eval_metric) > MAX_ABS_LOSS:
        return Refusal(
            Bound.eval_metric, f"eval_metric {eval_metric:g} is outside ±{MAX_ABS_LOSS:g}"
        )
    if group_size is not None:
        largest = MAX_GROUP_SIZE if view is None else min(MAX_GROUP_SIZE, view.peers)
        if group_size > largest:
            return Refusal(
                Bound.group_size,
                f"group_size {group_size} is larger than the {largest} peers that joined this run"
                if largest < MAX_GROUP_SIZE
                else f"group_size {group_size} is over the largest group, {MAX_GROUP_SIZE}",
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
