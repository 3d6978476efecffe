"""How one butterfly round (:class:`~peer.averaging.allreduce.round.ButterflyRound`) treats its
faults: who is excluded, in which role, and what their spans keep. Without I/O, mixed
into the machine (whose attributes these are). Each decision is local; survivors finish:

* a sender silent for ``sender_timeout`` while owing parts is excluded from this reducer's
  unfinished parts;
* a reducer silent for ``reducer_timeout`` fails: its remaining parts keep local values,
  kept in ``orphans`` for :mod:`peer.averaging.allreduce.recovery`;
* a member that takes no bytes of a frame for ``sender_timeout`` (transport signs of life
  count, via :meth:`~peer.averaging.allreduce.round.ButterflyRound.tick`), a broken link, a bad
  part, or an ``avg.abort`` excludes that member in both roles;
* NaN/Inf in this peer's own values ends the round at once with
  :class:`~peer.averaging.allreduce.vocabulary.Done` holding
  :class:`~peer.averaging.exceptions.BadContribution`.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch

from peer.averaging.allreduce.partition import Partition
from peer.averaging.allreduce.recovery import Orphans
from peer.averaging.allreduce.reducer import FinishedPart, WeightedMeanReducer
from peer.averaging.allreduce.results import RoundResults
from peer.averaging.allreduce.send import RoundSending
from peer.averaging.allreduce.vocabulary import Command, Done, MemberInfo, Tell
from peer.averaging.exceptions import BadContribution
from peer.compression import all_finite
from peer.wire import Frame

logger = logging.getLogger("peer.averaging.butterfly")

__all__ = ["RoundFaults"]


class RoundFaults:
    """Mixed into :class:`~peer.averaging.allreduce.round.ButterflyRound`: how it treats faults.

    Faults (each decision is local; survivors always finish):

    * a sender silent for ``sender_timeout`` while still owing parts is excluded from this
      reducer's parts not yet final;
    * a reducer silent for ``reducer_timeout`` (no average, no accepted send) fails: its span's
      remaining parts keep the local values. A member killed once its contributions went out is seen
      this way (nothing more is sent to it, so no send fails), and only by the members still owed
      one of its averages: :attr:`~peer.averaging.allreduce.round.ButterflyRound.left` names it with
      the members excluded in both roles. This member keeps a copy of its own values of those parts
      (:attr:`~peer.averaging.allreduce.round.ButterflyRound.orphans`), from which the survivors
      finish them after the round (:mod:`peer.averaging.allreduce.recovery`);
    * a member that takes nothing of a frame sent to it for ``sender_timeout`` (it stopped
      reading: a frozen process) is excluded in both roles. Silence is the absence of bytes, not of
      complete frames: the driver passes the transport's signs of life to
      :meth:`~peer.averaging.allreduce.round.ButterflyRound.tick` (on a bulk lane, the bytes of a
      frame still under way count), so a slow link whose frames take longer than the timeouts is not
      taken for a dead peer;
    * a link that breaks, a bad part (wrong size or dtype, NaN/Inf, undecodable), or an
      ``avg.abort`` from a member excludes that member in both roles; bad input is logged once
      and its sender told with ``avg.abort``;
    * this peer's own values with NaN/Inf: its span (all its values if it reduces nothing) is
      checked before the round; values for another reducer's span are checked by that reducer, which
      excludes this peer and tells it with ``avg.abort``, upon which this peer checks the values it
      sent there itself. Either way the round ends at once with
      :class:`~peer.averaging.allreduce.vocabulary.Done` holding
      :class:`~peer.averaging.exceptions.BadContribution` naming this peer: nothing more is reduced
      or sent (an average finished from then on would leave out the member that found the fault).
    """

    me: str
    index: int
    members: list[MemberInfo]
    peer_index: dict[str, int]
    partition: Partition
    flat: torch.Tensor
    weight: float
    is_sender: bool
    reducer: WeightedMeanReducer | None
    results: RoundResults
    sending: RoundSending
    unresolved: dict[int, set[int]]
    failed: set[str]
    failed_reducers: set[int]
    excluded_senders: set[str]
    orphans: Orphans
    error: BadContribution | None
    done: bool
    _logged: set[str]
    _commands: list[Command]

    if TYPE_CHECKING:  # what the class it is mixed into provides

        def abort_frame(self, reason: str) -> Frame: ...

        def _wake(self, peer_id: str) -> None: ...

        def _check_done(self) -> None: ...

        def _reject_bad(self) -> None: ...

        def _on_finished(self, finished: list[FinishedPart]) -> None: ...

    def _on_abort(self, sender: str, why: str) -> None:
        """``sender`` left the round, or excluded this peer. If it reduces a span, the values
        this peer sent it are checked now (on this rare event only, not before every send):
        non-finite, the round ends for this peer as if its own span held them; finite, the
        claim is a remote peer's and only that peer is dropped."""
        r = self.peer_index[sender]
        if (
            self.error is None
            and self.is_sender
            and self.weight > 0
            and r not in self.failed_reducers
            and self.partition.parts_of(r)
        ):
            start, stop = self.partition.spans[r]
            if not all_finite(self.flat[start:stop]):
                self._leave(BadContribution(self.me, None, "this peer's own values are not finite"))
                return
        self._peer_failed(sender, f"it left the round ({why})")

    def _leave(self, error: BadContribution) -> None:
        """This peer's own values are bad: it stops at once. Nothing more is reduced or
        sent (an average finished from here on would leave out the member that found the
        fault, whose values are good)."""
        self.error = error
        for peer_id in self.sending.outboxes:
            self._wake(peer_id)  # its senders learn that the outbox closed (next_send)
        self.done = True
        self._commands.append(Done(error))

    def _bad(self, sender: str, reason: str) -> None:
        if sender not in self._logged:
            self._logged.add(sender)
            logger.warning("excluding %s from the round: %s", sender, reason)
            # tell the offender, so that it stops waiting for our averages
            self._commands.append(Tell(sender, self.abort_frame("excluded")))
        r = self.peer_index[sender]
        if r != self.index and sender not in self.failed:
            # distrust everything it reduced, too: its whole span keeps the local values
            start, stop = self.partition.spans[r]
            self.results.distrust(r, self.flat[start:stop])
            self.unresolved[r].clear()
        self._peer_failed(sender, reason, log=False)

    def _exclude_sender(self, sender: str, reason: str) -> None:
        if sender in self.excluded_senders:
            return
        self.excluded_senders.add(sender)
        logger.info("excluding sender %s: %s", sender, reason)
        if self.reducer is not None and sender in self.reducer.senders:
            finished = self.reducer.exclude(sender)
            self._reject_bad()
            self._on_finished(finished)
        self._check_done()

    def _fail_reducer(self, r: int, reason: str) -> None:
        if r in self.failed_reducers or r == self.index:
            return
        self.failed_reducers.add(r)
        pending = self.unresolved.get(r, set())
        if pending:
            logger.info(
                "reducer %s failed (%s): %d parts keep local values",
                self.members[r].peer_id,
                reason,
                len(pending),
            )
        for index in pending:
            view = self.partition.part(r, index).view(self.flat)
            if self.is_sender:  # the survivors finish these parts after the round
                self.orphans.keep(r, index, view)
            self.results.keep_local(view)
        pending.clear()
        self._wake(self.members[r].peer_id)
        self._check_done()

    def _peer_failed(self, peer_id: str, reason: str, *, log: bool = True) -> None:
        if peer_id in self.failed or peer_id == self.me:
            return
        if log:
            logger.info("peer %s left the round: %s", peer_id, reason)
        self.failed.add(peer_id)
        box = self.sending.outboxes.get(peer_id)
        if box is not None:
            while box.averages:
                self.sending.release_wire(box.averages.popleft())
            box.contributions.clear()
            self._wake(peer_id)
        self._exclude_sender(peer_id, reason)
        self._fail_reducer(self.peer_index[peer_id], reason)
