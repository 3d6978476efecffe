"""How much credit a peer's samples counter earns: at most a small multiple of the rate the
coordinator measures for the run's other volunteers. Pure rules, no I/O, no clock.

* **Measured.** A volunteer's rate is its credited samples over the time since its first
  peer joined (once that is at least :data:`MEASURE_MIN_S`); only volunteers online and not
  banned count.
* **Bounded.** A peer earns at most ``multiple`` times the other volunteers' rate
  (:meth:`RunRates.median_of_others`: per invite the lower median, then the lower median of
  the invites) per second since it joined, plus :data:`CREDIT_GRACE_S`; before anyone else
  is measured, the run's ``floor``. No volunteer raises its own bound.
* **Clamped, not refused.** A report over the bound is credited up to it (the write clamps
  it, ``PendingReport.samples_cap``), its claimed samples/s likewise; credit never falls.

A run's :class:`RunRates` is one grouped query, read at most every ``report_swarm_refresh_s``
per worker; a report's bound is O(1) from it.
"""

from __future__ import annotations

from bisect import bisect_left, insort
from dataclasses import dataclass, field

from server.schemas import MAX_INT

# A volunteer is measured once its reports span this long (the first report comes about a
# report interval after the join; a shorter span is mostly start-up).
MEASURE_MIN_S = 5.0
# Seconds of work at the bound a peer may be credited beyond the time since it joined
# (counting that began just before its join, clocks of several workers).
CREDIT_GRACE_S = 5.0
# However slowly the others are measured to work, a peer may earn this many samples/s.
MIN_RATE = 100.0


@dataclass(frozen=True, slots=True)
class Measured:
    """One volunteer's credited samples and the span they were counted over; ``invite``:
    what it counts as once (its invite; a volunteer the organizer added is its own)."""

    volunteer_id: int
    samples: int
    span_ms: int
    invite: str = ""

    @property
    def rate(self) -> float | None:
        """Samples per second, or None while not measured (see the module)."""
        if self.samples <= 0 or self.span_ms < MEASURE_MIN_S * 1000:
            return None
        return self.samples * 1000 / self.span_ms

    @property
    def witness(self) -> str:
        return self.invite or f"volunteer {self.volunteer_id}"


def _lower_median(values: list[float]) -> float:
    return values[(len(values) - 1) // 2]


@dataclass(slots=True)
class RunRates:
    """The measured rates of a run's volunteers, grouped by invite, as read at ``read_ms``."""

    read_ms: int
    # invite -> its volunteers' measured rates, sorted
    by_invite: dict[str, list[float]] = field(default_factory=dict, repr=False)
    # every invite's lower median, sorted
    medians: list[float] = field(default_factory=list)
    # volunteer -> (its rate, its invite), for the measured ones
    index: dict[int, tuple[float, str]] = field(default_factory=dict, repr=False)

    @classmethod
    def of(cls, read_ms: int, volunteers: list[Measured]) -> RunRates:
        run = cls(read_ms)
        for m in volunteers:
            if (rate := m.rate) is not None:
                insort(run.by_invite.setdefault(m.witness, []), rate)
                run.index[m.volunteer_id] = (rate, m.witness)
        run.medians = sorted(_lower_median(rates) for rates in run.by_invite.values())
        return run

    def median_of_others(self, volunteer_id: int) -> float | None:
        """The lower median over invites of the measured rates of the volunteers other than
        ``volunteer_id`` (each invite: its volunteers' lower median); None when none is
        measured. O(log n): only the volunteer's own invite changes without it."""
        own = self.index.get(volunteer_id)
        if own is None:
            return _lower_median(self.medians) if self.medians else None
        rate, invite = own
        mates = self.by_invite[invite]
        # its invite's median without it (None: it was the invite's only measured volunteer)
        replacement = None
        if len(mates) > 1:
            k, at = (len(mates) - 2) // 2, bisect_left(mates, rate)
            replacement = mates[k] if k < at else mates[k + 1]
        # the invites' medians with its invite's replaced: drop one copy, insert the new one
        dropped = bisect_left(self.medians, _lower_median(mates))
        n = len(self.medians) - 1 + (replacement is not None)
        if n <= 0:
            return None

        def without(i: int) -> float:  # the i-th smallest once the own median is dropped
            return self.medians[i if i < dropped else i + 1]

        k = (n - 1) // 2
        if replacement is None:
            return without(k)
        below = bisect_left(self.medians, replacement)
        below -= below > dropped  # its place among the others once one copy is dropped
        if k < below:
            return without(k)
        return replacement if k == below else without(k - 1)


@dataclass(frozen=True, slots=True)
class CreditLimits:
    """The settings: ``multiple`` of the others' median, ``floor`` before any is measured,
    never above ``ceiling`` (the static per-peer limit)."""

    multiple: float
    floor: float
    ceiling: float

    def limit(self, rates: RunRates | None, volunteer_id: int) -> float:
        """The most samples/s a peer of ``volunteer_id`` is credited for."""
        median = None if rates is None else rates.median_of_others(volunteer_id)
        rate = self.floor if median is None else max(MIN_RATE, self.multiple * median)
        return min(rate, self.ceiling)

    def cap(self, limit: float, first_seen_ms: int, now_ms: int, credited: int) -> int:
        """The most a peer that joined at ``first_seen_ms`` and holds ``credited`` is
        credited in all by ``now_ms`` at ``limit`` samples/s: never less than it holds."""
        elapsed_s = max(0, now_ms - first_seen_ms) / 1000 + CREDIT_GRACE_S
        return max(credited, min(MAX_INT, int(limit * elapsed_s)))
