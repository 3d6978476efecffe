"""The weighted-mean reducer of one reducer's span (butterfly all-reduce), without I/O.

For each part of its span, a reducer receives ``(weight wⱼ, values xⱼ)`` from every sender
and answers every member with ``Σⱼ wⱼ·xⱼ / Σⱼ wⱼ``. :class:`WeightedMeanReducer` is fed one
event at a time: :meth:`~WeightedMeanReducer.accumulate` (or
:meth:`~WeightedMeanReducer.accumulate_range` for consecutive parts) and
:meth:`~WeightedMeanReducer.exclude` return the parts that became final, for the caller to
send. It accumulates in place into one preallocated buffer, keeps each contribution until
its part is final so an excluded sender is dropped exactly (by rebuilding), and with
``destination`` divides final averages straight into the caller's buffer. With a robust
``aggregator`` (:mod:`peer.averaging.allreduce.robust`) a part is aggregated once complete, and far
senders are queued in :attr:`WeightedMeanReducer.outliers`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Hashable, Iterable, Iterator, Mapping
from dataclasses import dataclass

import torch

from peer.averaging.allreduce.robust import aggregate, check_aggregator, outliers
from peer.averaging.exceptions import BadContribution, UnexpectedSender
from peer.compression import all_finite

__all__ = ["FinishedPart", "WeightedMeanReducer", "apply_averaging_alpha"]

#: float32 values up to this size aggregate in float32: squared and summed over a part of
#: millions of values they stay far from its largest finite number (3.4e38)
_FLOAT32_SAFE = 1e15


@dataclass(frozen=True)
class FinishedPart:
    """A part whose average is final.

    ``average`` is a view of the reducer's accumulator or the part's destination (shape
    ``[numel]``), valid until the
    reducer is dropped; ``None`` when no surviving sender had positive weight (everyone was
    excluded or auxiliary), or a robust aggregator found the part's two contributions too
    far apart (:func:`~peer.averaging.allreduce.robust.pair_average`): members then keep their local
    values for that part.
    ``senders`` are the senders whose values are in the average.
    """

    index: int
    average: torch.Tensor | None
    total_weight: float
    senders: frozenset[Hashable]


class WeightedMeanReducer:
    """Σ wᵢ·xᵢ / Σ wᵢ over the senders, part by part, into a preallocated buffer.

    ``part_sizes`` are the element counts of the span's parts (``Partition.part_sizes``);
    ``senders`` the peers expected to contribute to every part. A part is final once every
    sender not excluded has contributed to it. A sender with weight 0 (auxiliary) counts as
    having contributed but adds nothing (its values may be ``None``).

    Errors: a malformed contribution (duplicate, unknown part, bad weight, shape or dtype)
    raises :class:`BadContribution` (or :class:`UnexpectedSender`) naming the offender and
    changes nothing; the caller's next step is ``exclude(err.sender)`` and sending back the
    parts that returns. NaN/Inf values are found when a part is complete, by one check of
    its sum (not one per contribution): the senders whose values in it are not finite are
    then excluded as by :meth:`exclude`, the part is rebuilt from the others, and each
    offence is queued in :attr:`rejected` for the caller to act on (:meth:`take_rejected`).
    Finite values whose weighted sum overflows are blamed on the sender with the largest
    ``w·max|x|`` in the part, excluded the same way: an average is never infinite.
    A sender's values count as valid once every part it contributed to is final.

    ``max_weight`` bounds a contribution's weight; ``declared`` (sender → weight, from
    matchmaking) is the weight each sender announced, which its contributions must carry.
    ``aggregator`` other than ``"mean"`` aggregates each complete part robustly instead.

    Memory: one preallocated accumulator ``[span numel]`` in the accumulation dtype, written in
    place as contributions arrive, so reducing overlaps receiving: a part's first positive
    contribution is only remembered, the second is written together with it
    (``acc = w₁·x₁ + w₂·x₂``, one pass and no zeroing), the rest as ``acc += w·x``; a part with a
    single contributor is that contributor's values, untouched. With ``destination``, a final
    average is divided straight into the caller's buffer (one pass fewer).
    :meth:`accumulate_range` takes several consecutive parts of one sender at once (one
    arithmetic call per run of parts). To drop an
    excluded sender's contribution *exactly* (no floating-point subtraction), the reducer keeps
    a reference to each contribution of a part until that part is final and rebuilds the
    affected accumulators from the survivors'; references are released at finalisation, so
    memory beyond the accumulator is bounded by the contributions of parts still in flight.

    With a robust ``aggregator`` (:mod:`peer.averaging.allreduce.robust`) nothing is accumulated: a
    part is aggregated from its retained contributions once it has them all, into the same buffers,
    and the senders whose values lie far from the aggregate
    (:func:`~peer.averaging.allreduce.robust.outliers`) are queued in
    :attr:`WeightedMeanReducer.outliers` for the caller to name.
    """

    def __init__(
        self,
        part_sizes: Iterable[int],
        senders: Iterable[Hashable],
        dtype: torch.dtype = torch.float32,
        accumulate_dtype: torch.dtype | None = None,
        out: torch.Tensor | None = None,
        destination: torch.Tensor | None = None,
        max_weight: float = math.inf,
        declared: Mapping[Hashable, float] | None = None,
        aggregator: str = "mean",
    ) -> None:
        if not max_weight > 0:
            raise ValueError("max_weight must be positive")
        self.max_weight = float(max_weight)
        self.declared = dict(declared) if declared is not None else None
        self.aggregator = check_aggregator(aggregator)
        self._streamed = aggregator == "mean"  # else: aggregated when a part is complete
        self.part_sizes = tuple(part_sizes)
        if any(size < 0 for size in self.part_sizes):
            raise ValueError("part sizes must be non-negative")
        self.senders = frozenset(senders)
        if not self.senders:
            raise ValueError("a reducer needs at least one sender")
        self.dtype = dtype
        if accumulate_dtype is None:
            # half-precision sums lose too much; accumulate those in fp32
            accumulate_dtype = torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype
        self.offsets = [0]
        for size in self.part_sizes:
            self.offsets.append(self.offsets[-1] + size)
        if out is None:
            self.buffer = torch.zeros(self.offsets[-1], dtype=accumulate_dtype)  # [span numel]
        else:
            # a caller-owned accumulator reused across rounds (no fresh pages to fault in)
            if out.shape != (self.offsets[-1],) or out.dtype != accumulate_dtype:
                raise ValueError(f"out must be a {accumulate_dtype}[{self.offsets[-1]}] tensor")
            self.buffer = out  # no zeroing: a part's first contribution overwrites it
        if destination is not None and destination.shape != (self.offsets[-1],):
            raise ValueError(f"destination must be a [{self.offsets[-1]}] tensor")
        # part i's average is written to its slice of destination (which may hold a retained
        # contribution: that is released when the part becomes final, before the write)
        self.destination = destination
        self._weights: dict[Hashable, float] = {}
        self._total_weight = [0.0] * len(self.part_sizes)
        # part index → sender → (weight, values) still needed to rebuild after an exclusion
        self._pending: list[dict[Hashable, tuple[float, torch.Tensor | None]] | None] = [
            {} for _ in self.part_sizes
        ]
        self.excluded: set[Hashable] = set()
        # offences found when completing parts (NaN/Inf values), for the caller
        self.rejected: list[BadContribution] = []
        # robust aggregators: (sender, part index, distance / median distance) of the
        # contributions far from a part's aggregate, for the caller to name
        self.outliers: list[tuple[Hashable, int, float]] = []
        self._open_parts = len(self.part_sizes)  # parts not final yet
        # part index → the part's only positive contribution so far, not yet written to the
        # accumulator: (weight, values of the batch it came in, the part's offset there).
        # The second contribution is then written together with it in one pass
        # (acc = w₁·x₁ + w₂·x₂), and a part with a single contributor needs no arithmetic.
        self._lone: list[tuple[float, torch.Tensor, int] | None] = [None] * len(self.part_sizes)

    # ---------------------------------------------------------------- queries

    @property
    def num_parts(self) -> int:
        return len(self.part_sizes)

    @property
    def active_senders(self) -> frozenset[Hashable]:
        return self.senders - self.excluded

    def is_final(self, index: int) -> bool:
        return self._pending[index] is None

    @property
    def is_finished(self) -> bool:
        """Every part is final."""
        return not self._open_parts

    def waiting_for(self, index: int) -> frozenset[Hashable]:
        """Senders whose contribution to part ``index`` is still missing."""
        pending = self._pending[index]
        if pending is None:
            return frozenset()
        return self.active_senders - pending.keys()

    def part_view(self, index: int) -> torch.Tensor:
        return self.buffer[self.offsets[index] : self.offsets[index + 1]]

    def take_outliers(self) -> list[tuple[Hashable, int, float]]:
        """The outliers found since the last call (robust aggregators only)."""
        found, self.outliers = self.outliers, []
        return found

    def take_rejected(self) -> list[BadContribution]:
        """The offences found since the last call (their senders are already excluded)."""
        rejected, self.rejected = self.rejected, []
        return rejected

    # ----------------------------------------------------------------- events

    def accumulate_range(
        self, sender: Hashable, index: int, count: int, values: torch.Tensor, weight: float = 1.0
    ) -> list[FinishedPart]:
        """:meth:`accumulate` for parts ``index .. index+count-1`` of ``sender`` at once;
        ``values`` is their concatenation. Validated as a whole first: on a
        :class:`BadContribution` nothing changed."""
        if count == 1:
            return self.accumulate(sender, index, values, weight)
        if sender not in self.senders:
            raise UnexpectedSender(sender, index, "not a sender of this reducer")
        if sender in self.excluded:
            return []
        if (
            type(index) is not int
            or type(count) is not int
            or count < 1
            or not 0 <= index <= len(self.part_sizes) - count
        ):
            raise BadContribution(sender, None, f"no parts {index!r}+{count!r} in this span")
        stop = index + count
        for i in range(index, stop):
            pending = self._pending[i]
            if pending is None or sender in pending:
                raise BadContribution(sender, i, "duplicate contribution")
        weight = self._check_weight(sender, index, weight)
        start_at, stop_at = self.offsets[index], self.offsets[stop]
        self._check_values(sender, index, values, stop_at - start_at)
        if weight > 0 and self._streamed:
            self._add(index, stop, values, weight)
        for i in range(index, stop):
            part = values[self.offsets[i] - start_at : self.offsets[i + 1] - start_at]
            self._pending[i][sender] = (weight, part)  # type: ignore[index]
            self._total_weight[i] += weight
        return self._finalise_ready(range(index, stop))

    def accumulate(
        self, sender: Hashable, index: int, values: torch.Tensor | None, weight: float = 1.0
    ) -> list[FinishedPart]:
        """Add ``weight · values`` from ``sender`` to part ``index``; return parts now final.

        ``values`` has shape ``[part_sizes[index]]`` and dtype :attr:`dtype`.
        A contribution from an excluded sender (late arrival) is ignored. Raises
        :class:`BadContribution` for a duplicate, an unknown part, a bad weight (negative,
        non-finite or different from the sender's earlier parts), shape or dtype; NaN/Inf
        values are dealt with when the part is complete (see the class docstring).
        """
        if sender not in self.senders:
            raise UnexpectedSender(sender, index, "not a sender of this reducer")
        if sender in self.excluded:
            return []
        if not isinstance(index, int) or not 0 <= index < len(self.part_sizes):
            raise BadContribution(sender, None, f"no part {index!r} in this span")
        pending = self._pending[index]
        if pending is None or sender in pending:
            raise BadContribution(sender, index, "duplicate contribution")
        weight = self._check_weight(sender, index, weight)
        if values is not None or weight > 0:
            self._check_values(sender, index, values, self.part_sizes[index])
        pending[sender] = (weight, values)
        if weight > 0:
            assert values is not None
            if self._streamed:
                self._add(index, index + 1, values, weight)
            self._total_weight[index] += weight
        return self._finalise_ready([index])

    def vouch(self, sender: Hashable) -> list[FinishedPart]:
        """Check now ``sender``'s values in the parts not final yet (they are otherwise
        checked when each part completes), so that it is known valid before the span is:
        call it once the sender has contributed to every part. A non-finite value excludes
        the sender as a completed part would (queued in :attr:`rejected`); returns the
        parts that became final because of that."""
        if sender in self.excluded:
            return []
        for index, pending in enumerate(self._pending):
            contribution = pending.get(sender) if pending is not None else None
            if contribution is None or contribution[0] == 0 or contribution[1] is None:
                continue
            if not all_finite(contribution[1]):
                self.rejected.append(BadContribution(sender, index, "NaN or Inf values"))
                return self._finalise_ready(self._drop(sender))
        return []

    def exclude(self, sender: Hashable) -> list[FinishedPart]:
        """Stop waiting for ``sender``; drop its contributions to parts not yet final.

        Parts it contributed to that are already final keep its values. Returns the parts
        that became final because they were only waiting for this sender. Idempotent.
        """
        if sender not in self.senders:
            raise ValueError(f"{sender!r} is not a sender of this reducer")
        if sender in self.excluded:
            return []
        return self._finalise_ready(self._drop(sender))

    def _drop(self, sender: Hashable) -> list[int]:
        """Exclude ``sender``: rebuild the open parts it contributed to; the open parts."""
        self.excluded.add(sender)
        touched = []
        for index, pending in enumerate(self._pending):
            if pending is None:
                continue
            touched.append(index)
            if sender in pending:
                del pending[sender]
                self._rebuild(index, pending)
        return touched

    # -------------------------------------------------------------- internals

    def _add(self, index: int, stop: int, values: torch.Tensor, weight: float) -> None:
        """Take ``weight · values`` (parts ``index..stop-1``, concatenated) into the
        accumulator. Per part: the first positive contribution is only remembered; the
        second is written together with it; later ones are added. Runs of parts in the same
        situation take one call each."""
        offsets, lone = self.offsets, self._lone
        base = offsets[index]
        i = index
        while i < stop:
            j = i + 1
            if self._total_weight[i] == 0:  # the first: remember it
                while j < stop and self._total_weight[j] == 0:
                    j += 1
                for k in range(i, j):
                    lone[k] = (weight, values, offsets[k] - base)
            elif lone[i] is not None:  # the second: acc = w₁·x₁ + w·x, one pass
                w1, x1, at = lone[i]  # type: ignore[misc]
                end = at + offsets[j] - offsets[i]
                while j < stop:  # a run whose first contributions are adjacent in one batch
                    nxt = lone[j]
                    if nxt is None or nxt[0] != w1 or nxt[1] is not x1 or nxt[2] != end:
                        break
                    end += offsets[j + 1] - offsets[j]
                    j += 1
                region = self.buffer[offsets[i] : offsets[j]]
                first = x1[at:end]
                mine = values[offsets[i] - base : offsets[j] - base]
                if w1 == 1.0:
                    torch.add(first, mine, alpha=weight, out=region)
                elif weight == 1.0:
                    torch.add(mine, first, alpha=w1, out=region)
                else:
                    torch.mul(first, w1, out=region)
                    region.add_(mine, alpha=weight)
                for k in range(i, j):
                    lone[k] = None
            else:  # later ones
                while j < stop and self._total_weight[j] != 0 and lone[j] is None:
                    j += 1
                region = self.buffer[offsets[i] : offsets[j]]
                region.add_(values[offsets[i] - base : offsets[j] - base], alpha=weight)
            i = j

    def _rebuild(
        self, index: int, pending: dict[Hashable, tuple[float, torch.Tensor | None]]
    ) -> None:
        # recompute from the survivors instead of subtracting: exact, and cheap (one part)
        survivors = [(w, v) for w, v in pending.values() if w > 0 and v is not None]
        self._total_weight[index] = sum(w for w, _ in survivors)
        self._lone[index] = None
        if not self._streamed:
            return  # aggregated from ``pending`` when complete
        if len(survivors) == 1:
            weight, values = survivors[0]
            self._lone[index] = (weight, values, 0)
        elif survivors:
            view = self.part_view(index)
            (w1, x1), *rest = survivors
            torch.mul(x1, w1, out=view)
            for weight, values in rest:
                view.add_(values, alpha=weight)

    def _finalise_ready(self, indices: Iterable[int]) -> list[FinishedPart]:
        ready = []
        active = self.active_senders
        for index in indices:
            pending = self._pending[index]
            if pending is not None and active <= pending.keys():
                ready.append(index)
        if not ready:
            return []
        culprits = self._screen(ready)
        if culprits:  # excluded now: the parts they were in are rebuilt without them
            touched: set[int] = set()
            for sender, (index, reason) in culprits.items():
                self.rejected.append(BadContribution(sender, index, reason))
                touched.update(self._drop(sender))
            return self._finalise_ready(sorted(touched))
        results = self.destination if self.destination is not None else self.buffer
        if not self._streamed:
            for index in ready:
                self._aggregate_into(index, results)
            return self._release(ready, results)
        # a part with a single contributor: its values are the average, exactly
        divided = []
        for index in ready:
            lone = self._lone[index]
            if lone is None:
                divided.append(index)
                continue
            self._lone[index] = None
            _, values, offset = lone
            source = values[offset : offset + self.part_sizes[index]]
            target = results[self.offsets[index] : self.offsets[index + 1]]
            if source.data_ptr() != target.data_ptr():
                target.copy_(source)
        # divide runs of consecutive parts with the same total weight in one call each
        weights = self._total_weight
        for first, last in _runs(divided, lambda a, b: weights[a] == weights[b]):
            total = weights[first]
            if total > 0:
                lo, hi = self.offsets[first], self.offsets[last + 1]
                if self.destination is not None:
                    torch.div(self.buffer[lo:hi], total, out=self.destination[lo:hi])
                else:
                    self.buffer[lo:hi].div_(total)
        return self._release(ready, results)

    def _aggregate_into(self, index: int, results: torch.Tensor) -> None:
        """Part ``index`` by the robust aggregator, from its retained contributions."""
        pending = self._pending[index]
        assert pending is not None
        survivors = [(s, w, v) for s, (w, v) in pending.items() if w > 0 and v is not None]
        if not survivors:
            return
        stack = torch.stack([v for _, _, v in survivors])  # [n, numel]
        if stack.dtype != torch.float32 or float(stack.abs().max()) > _FLOAT32_SAFE:
            # in float64: finite values cannot overflow there, so neither can their aggregate
            stack = stack.to(torch.float64)
        average = aggregate(self.aggregator, stack, [w for _, w, _ in survivors])
        if average is None:  # a pair too far apart: each member keeps its own values
            self._total_weight[index] = 0.0  # released with no average (see FinishedPart)
            return
        results[self.offsets[index] : self.offsets[index + 1]].copy_(average)
        for row, ratio in outliers(stack, average):
            self.outliers.append((survivors[row][0], index, ratio))

    def _release(self, ready: list[int], results: torch.Tensor) -> list[FinishedPart]:
        done = []
        for index in ready:
            pending = self._pending[index]
            assert pending is not None
            total = self._total_weight[index]
            average = results[self.offsets[index] : self.offsets[index + 1]] if total > 0 else None
            contributors = frozenset(s for s, (w, _) in pending.items() if w > 0)
            self._pending[index] = None  # releases the retained contributions
            self._open_parts -= 1
            done.append(FinishedPart(index, average, total, contributors))
        return done

    def _screen(self, ready: list[int]) -> dict[Hashable, tuple[int, str]]:
        """Check the sums of complete parts for NaN/Inf (one pass over each run of adjacent
        accumulated parts); for a part that fails, find the senders with non-finite values
        in it, or if all are finite (their weighted sum overflows), the sender with the
        largest ``w·max|x|``. Returns them, each with the first such part and why. Without
        a sum (robust aggregator), every contribution of the complete parts is checked."""
        offsets, lone, buffer = self.offsets, self._lone, self.buffer
        suspects: list[int] = []
        summed: list[int] = []  # parts whose sum is in the accumulator, in order
        if not self._streamed:
            suspects = [i for i in ready if self._total_weight[i] > 0]
            ready = []
        for index in ready:
            first = lone[index]
            if first is not None:  # a single contributor: its values are the average
                _, values, at = first
                if not all_finite(values[at : at + self.part_sizes[index]]):
                    suspects.append(index)
            elif self._total_weight[index] > 0:
                summed.append(index)
        for low, high in _runs(summed):  # adjacent in the accumulator: one check each
            if not all_finite(buffer[offsets[low] : offsets[high + 1]]):
                suspects.extend(
                    i
                    for i in range(low, high + 1)
                    if not all_finite(buffer[offsets[i] : offsets[i + 1]])
                )
        culprits: dict[Hashable, tuple[int, str]] = {}
        for index in suspects:
            pending = self._pending[index]
            assert pending is not None
            found = False
            for sender, (weight, contribution) in pending.items():
                if weight > 0 and contribution is not None and not all_finite(contribution):
                    culprits.setdefault(sender, (index, "NaN or Inf values"))
                    found = True
            if not found and self._streamed:  # finite values, but their sum overflows
                sender, size = max(
                    (
                        (s, w * float(x.abs().max()))
                        for s, (w, x) in pending.items()
                        if w > 0 and x is not None and x.numel()
                    ),
                    key=lambda item: item[1],
                )
                reason = f"its values overflow the sum (weight * largest |value| = {size:.3g})"
                culprits.setdefault(sender, (index, reason))
        return culprits

    def _check_weight(self, sender: Hashable, index: int, weight: float) -> float:
        try:
            weight = float(weight)
        except (TypeError, ValueError):
            raise BadContribution(sender, index, f"weight {weight!r} is not a number") from None
        if not math.isfinite(weight) or weight < 0:
            raise BadContribution(sender, index, f"weight {weight} must be finite and >= 0")
        if self.declared is not None:
            declared = self.declared.get(sender)
            if declared is None or declared != weight:
                said = "no weight" if declared is None else f"the {declared:g}"
                raise BadContribution(
                    sender, index, f"weight {weight:g} differs from {said} it declared"
                )
        if weight > self.max_weight:
            raise BadContribution(
                sender, index, f"weight {weight:g} is over the bound of {self.max_weight:g}"
            )
        previous = self._weights.setdefault(sender, weight)
        if previous != weight:
            raise BadContribution(sender, index, f"weight {weight} differs from earlier {previous}")
        return weight

    def _check_values(
        self,
        sender: Hashable,
        index: int,
        values: torch.Tensor | None,
        numel: int,
    ) -> None:
        """``values`` must be a ``[numel]`` tensor of :attr:`dtype`."""
        if not isinstance(values, torch.Tensor):
            raise BadContribution(sender, index, "values missing")
        if values.shape != (numel,):
            raise BadContribution(sender, index, f"shape {list(values.shape)}, expected [{numel}]")
        if values.dtype != self.dtype:
            raise BadContribution(sender, index, f"dtype {values.dtype}, expected {self.dtype}")


def _runs(
    indices: list[int], alike: Callable[[int, int], bool] | None = None
) -> Iterator[tuple[int, int]]:
    """``(first, last)`` of each run of consecutive ``indices`` (sorted) whose members are
    ``alike(first, index)``."""
    start = 0
    for end in range(1, len(indices) + 1):
        if (
            end < len(indices)
            and indices[end] == indices[end - 1] + 1
            and (alike is None or alike(indices[start], indices[end]))
        ):
            continue
        yield indices[start], indices[end - 1]
        start = end


def apply_averaging_alpha(
    local: torch.Tensor, average: torch.Tensor, alpha: float = 1.0
) -> torch.Tensor:
    """Move ``local`` toward ``average`` in place: ``local += alpha · (average - local)``.

    ``alpha=1`` replaces ``local`` by the average exactly (hivemind's ``averaging_alpha``);
    smaller values give a damped, exponential-moving-average update. Returns ``local``.
    """
    if not 0.0 <= alpha <= 1.0 or math.isnan(alpha):
        raise ValueError(f"averaging_alpha must be in [0, 1], got {alpha}")
    with torch.no_grad():
        if alpha == 1.0:
            return local.copy_(average)
        if alpha == 0.0:
            return local
        if local.dtype == average.dtype:
            return local.lerp_(average, alpha)
        return local.lerp_(average.to(local.dtype), alpha)
