"""Where a butterfly round's results go: each part's slot in the flat buffer.

When a part's average arrives its slot is rewritten, in one of two modes:

* ``in_place=False`` (*delta*): the slot becomes ``average - local``; the caller adds
  ``alpha · delta`` to the tensors (a failed reducer's span keeps the local values);
* ``in_place=True``: the slot becomes ``local + alpha · (average - local)``; averages from a
  reducer whose own contributions to this peer's span are not all in and checked are held
  until they are (and dropped if it turns out bad).

:class:`RoundResults` does the writes and holds untrusted averages; :func:`check_plausible`
and :func:`check_pair` refuse averages a robust aggregator cannot have produced. No I/O.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from peer.averaging.allreduce.robust import PAIR_RADIUS, within_pair_radius

__all__ = ["FORGED_AVERAGE_FACTOR", "PAIR_SLACK", "RoundResults", "check_pair", "check_plausible"]

#: how far past :data:`~peer.averaging.allreduce.robust.PAIR_RADIUS` (relatively) a pair's average
#: may move this peer's values: the reducer checked the exact average, a lossy codec rounds it
PAIR_SLACK = 0.1

#: with a robust aggregator, an average holding values over this many times the largest
#: of this peer's own values there (at least 1) is forged: its reducer is treated as bad
FORGED_AVERAGE_FACTOR = 1e6


class RoundResults:
    """The result slots of one member's round (the rules are below). ``trusted``: the
    reducers whose averages are written at once (nothing, or nothing more, to check of
    them); the others' are held until :meth:`trust`.

    When the average of a part arrives, the part's slot in the flat buffer is rewritten (the
    local values were already sent, or are no longer needed by anyone: the reducer only
    finalises a part once it has them or has excluded this peer). Two modes:

    * ``in_place=False`` (*delta*): the slot becomes ``average - local``; the caller adds
      ``alpha · delta`` to the tensors, so a failed reducer's span (delta 0) keeps the local
      values and updates made to the tensors during the round are preserved.
    * ``in_place=True``: ``flat`` is the averaged tensors' memory (or a copy the caller writes
      back) and the slot becomes ``local + alpha · (average - local)`` as soon as the average is
      known — except that averages from a reducer whose own contributions to this peer's span are
      not all in and checked yet are held until they are (a reducer found bad meanwhile then leaves
      its whole span at the local values, as in delta mode; once they are all in and valid, its held
      averages are written). Contributions are checked for NaN/Inf with the sums of the parts they
      are in (:class:`~peer.averaging.allreduce.reducer.WeightedMeanReducer`), and a sender's values
      in parts still open when its last one arrives right then. Two passes over the tensors fewer
      than delta mode, and no snapshot.
    """

    def __init__(self, *, in_place: bool, alpha: float, trusted: set[int]) -> None:
        self.in_place = in_place
        self.alpha = alpha
        self.trusted = trusted
        # in place: reducer index → (slot, average) held until that reducer's contributions
        # to this peer's span are all in
        self._deferred: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}

    def write(self, view: torch.Tensor, average: torch.Tensor) -> None:
        """The part's local values in ``view`` are no longer needed: write the result."""
        if not self.in_place:
            torch.sub(average, view, out=view)  # delta = average - local, one pass
        elif self.alpha == 1.0:
            if average.data_ptr() != view.data_ptr():  # else: the reducer wrote it there
                view.copy_(average)
        elif self.alpha:
            view.lerp_(average, self.alpha)

    def keep_local(self, view: torch.Tensor) -> None:
        """The slot keeps this peer's own values."""
        if not self.in_place:
            view.zero_()  # delta 0

    def place(self, r: int, view: torch.Tensor, average: torch.Tensor) -> None:
        """Reducer ``r``'s average for ``view``: written now, or held until :meth:`trust`."""
        if self.in_place and r not in self.trusted:
            self._deferred.setdefault(r, []).append((view, average))
        else:
            self.write(view, average)

    def trust(self, r: int) -> None:
        """Reducer ``r`` sent all its contributions to this peer, all checked and valid:
        write the averages held from it, and any later ones at once."""
        if r not in self.trusted:
            self.trusted.add(r)
            for view, average in self._deferred.pop(r, []):
                self.write(view, average)

    def distrust(self, r: int, span: torch.Tensor) -> None:
        """Reducer ``r`` is bad: its whole ``span`` keeps the local values."""
        if self.in_place:
            self._deferred.pop(r, None)
        else:
            span.zero_()

    def finish(self) -> None:
        """The round is over: write the averages still held."""
        deferred, self._deferred = self._deferred, {}
        for writes in deferred.values():
            for view, average in writes:
                self.write(view, average)


def check_plausible(average: torch.Tensor, flat: torch.Tensor, start: int, aggregator: str) -> None:
    """A robust aggregate stays among the honest contributions, so a reducer's average
    cannot hold values orders of magnitude beyond this peer's own (``flat`` from ``start``
    on): ``ValueError`` if it does (one pass over the average; this peer's values are read
    only then)."""
    largest = float(average.abs().max()) if average.numel() else 0.0
    if largest <= FORGED_AVERAGE_FACTOR:
        return
    mine = flat[start : start + average.numel()]
    own = max(float(mine.abs().max()), 1.0)
    if largest > FORGED_AVERAGE_FACTOR * own:
        raise ValueError(
            f"values up to {largest:.3g}, over {FORGED_AVERAGE_FACTOR:g} times this "
            f"peer's own there ({own:.3g}): no {aggregator} of the group holds that"
        )


def check_pair(
    average: torch.Tensor, flat: torch.Tensor, parts: Sequence[tuple[int, int, int]]
) -> None:
    """In a round of two senders under a robust aggregator, each part's average may move
    this peer's own values there by at most :data:`~peer.averaging.allreduce.robust.PAIR_RADIUS`
    (plus :data:`PAIR_SLACK`) times their norm. ``parts`` are ``(offset in average, start,
    stop)``: the part's average is ``average[offset : offset + stop - start]``, this peer's
    own values ``flat[start:stop]``. ``ValueError`` for the first part that moves further
    (the reducer could not have sent it, or lies)."""
    for at, start, stop in parts:
        got = average[at : at + stop - start]
        if not within_pair_radius(got, flat[start:stop], PAIR_SLACK):
            moved = float((got - flat[start:stop].to(got.dtype)).norm())
            own = float(flat[start:stop].norm())
            raise ValueError(
                f"a pair's average moves this peer's values by {moved:.3g}, over "
                f"{PAIR_RADIUS:g} times their norm ({own:.3g})"
            )
