"""One butterfly all-reduce round of an assembled group: a state machine without I/O.

The flat vector is split into one span per member (by bandwidth; client-mode members get
none). Every non-auxiliary member streams its values of span ``r`` to member ``r`` in
parts; member ``r`` reduces each part as it arrives and sends the weighted mean back.

Use: one :class:`ButterflyRound` per member and round, driven by
:class:`~peer.averaging.allreduce.runner.AllreduceRunner`, which feeds it events
(:meth:`~ButterflyRound.start`, :meth:`~ButterflyRound.on_frame`,
:meth:`~ButterflyRound.sent`, :meth:`~ButterflyRound.tick`), carries out the commands each
call returns (:class:`Wake`, :class:`Tell`, :class:`Done`) and pulls frames with
:meth:`~ButterflyRound.next_send`. Time is only an argument (``now``), so tests feed it
interleavings of events. Its parts: ``butterfly_types``, ``butterfly_plan``,
``butterfly_send``, ``butterfly_results``, ``butterfly_decode``, ``butterfly_faults``.
"""

from __future__ import annotations

import collections
import logging
from collections.abc import Callable, Iterable, Sequence
from typing import Any, ClassVar

import torch

from peer.averaging.allreduce.decode import average_values, batch_sizes, contribution_values
from peer.averaging.allreduce.faults import RoundFaults
from peer.averaging.allreduce.partition import FlatLayout
from peer.averaging.allreduce.plan import make_reducer, plan_round
from peer.averaging.allreduce.recovery import Orphans
from peer.averaging.allreduce.reducer import FinishedPart
from peer.averaging.allreduce.results import (
    FORGED_AVERAGE_FACTOR,
    RoundResults,
    check_pair,
    check_plausible,
)
from peer.averaging.allreduce.send import NOT_YET, RoundSending
from peer.averaging.allreduce.vocabulary import (
    AllreduceConfig,
    Command,
    Done,
    Idle,
    MemberInfo,
    Send,
    Tell,
    Wake,
)
from peer.averaging.exceptions import BadContribution
from peer.averaging.matchmaking.messages import GroupInfo
from peer.averaging.protocol import ABORT, AVERAGE, PART
from peer.compression import (
    Compression,
    CompressionError,
    TensorRole,
    all_finite,
    extract,
)
from peer.wire import Frame

logger = logging.getLogger(__name__)

__all__ = [
    "FORGED_AVERAGE_FACTOR",
    "AllreduceConfig",
    "ButterflyRound",
    "Command",
    "Done",
    "Idle",
    "MemberInfo",
    "Send",
    "Tell",
    "Wake",
]


def _never(peer_id: str) -> float:
    return 0.0


SendingFactory = Callable[..., RoundSending]


class ButterflyRound(RoundFaults):
    """One member's side of one round (see also below). After :class:`Done` and
    :meth:`finish`, ``flat`` holds the round's result.

    What a subclass overrides (tests do): :attr:`sending_class` builds the round's sending
    side (:class:`~peer.averaging.allreduce.send.RoundSending`, given its keyword arguments;
    a subclass whose frames misbehave).

    The machine
    -----------
    One per member and round. Its driver
    (:class:`~peer.averaging.allreduce.runner.AllreduceRunner`) feeds it events and carries out the
    commands each call returns, in any order (none of them waits for another):

    * events: :meth:`~ButterflyRound.start`, a frame from a member
      (:meth:`~ButterflyRound.on_frame`), a frame handed to the transport or lost with its link
      (:meth:`~ButterflyRound.sent`), and the watchdog's :meth:`~ButterflyRound.tick` with the
      transport's signs of life;
    * commands: :class:`Wake` (the outbox to a member has something new, or closed),
      :class:`Tell` (send this notice to a member, best effort) and :class:`Done` (the round is
      over for this member; with an error if its own values are bad);
    * what to send next to a member is pulled, not pushed: :meth:`~ButterflyRound.next_send`
      gives the next frame of that member's outbox (contributions first, then averages as they
      are ready), so that one frame per member is under way at a time and consecutive parts
      ready together travel as one frame.
    """

    sending_class: ClassVar[SendingFactory] = RoundSending

    def __init__(
        self,
        me: str,
        prefix: str,
        group: GroupInfo,
        members: Sequence[MemberInfo],
        layout: FlatLayout,
        flat: torch.Tensor,
        *,
        weight: float,
        compression: Compression,
        roles: Sequence[TensorRole] | None,
        config: AllreduceConfig,
        scratch: Callable[[int, torch.dtype], torch.Tensor] | None = None,
        in_place: bool = False,
        alpha: float = 1.0,
    ) -> None:
        self.prefix = prefix
        self.group = group
        self.members = list(members)
        self.me = me
        self.index = group.index_of(me)
        self.peer_index = {m.peer_id: i for i, m in enumerate(self.members)}
        self.layout = layout
        self.flat = flat  # [total], layout.dtype; local values, turned into results
        self.in_place = in_place
        self.alpha = float(alpha)
        self._accepted: collections.Counter[str] = collections.Counter()  # parts per sender
        self.weight = float(weight)
        self.config = config
        self.is_sender = not self.members[self.index].auxiliary
        plan = plan_round(
            me, self.members, layout, compression=compression, roles=roles, config=config
        )
        senders = plan.senders
        self.weight_bound = plan.weight_bound
        self.overweight = plan.overweight
        self.partition = plan.partition
        self._sizes = plan.sizes
        self._plain = plan.plain
        # two senders under a robust aggregator: no majority, so each member holds every
        # average to the pair's bound on its own (robust.pair_average)
        self._pair = config.aggregator != "mean" and plan.weighted_senders == 2
        self.reducer = make_reducer(
            plan,
            self.index,
            layout,
            flat,
            config=config,
            scratch=scratch,
            in_place=in_place,
            alpha=alpha,
        )
        self.finished: dict[int, FinishedPart] = {}
        sending_to_me = set(senders) if self.reducer is not None else set()
        # reducers whose averages this peer writes at once: nothing (more) to check of them
        self.results = RoundResults(
            in_place=in_place,
            alpha=self.alpha,
            trusted={r for r, m in enumerate(self.members) if m.peer_id not in sending_to_me},
        )
        # other reducers' parts still waiting for their average
        self.unresolved: dict[int, set[int]] = {
            r: set(range(len(self.partition.parts_of(r))))
            for r in range(len(self.members))
            if r != self.index
        }
        self.failed: set[str] = set()  # excluded in both roles
        self.failed_reducers: set[int] = set()
        # own values of the parts dead reducers left open (butterfly_recovery)
        self.orphans = Orphans()
        self.excluded_senders: set[str] = set()
        self._logged: set[str] = set()
        self._outliers_named: set[str] = set()
        self.sending = type(self).sending_class(
            prefix=prefix,
            group=group,
            index=self.index,
            peer_index=self.peer_index,
            flat=flat,
            weight=self.weight,
            partition=self.partition,
            sizes=self._sizes,
            plain=self._plain,
            reducer=self.reducer,
            finished=self.finished,
            unresolved=self.unresolved,
            failed_reducers=self.failed_reducers,
            is_sender=self.is_sender,
        )
        self.last_from: dict[str, float] = dict.fromkeys(senders, 0.0)
        self.last_progress: dict[int, float] = dict.fromkeys(self.unresolved, 0.0)
        self.done = False
        self.error: BadContribution | None = None  # own values found not finite
        self._wakes: dict[str, None] = {}  # commands not yet returned, in order
        self._commands: list[Command] = []

    # ------------------------------------------------------------------ events

    def start(self, now: float, early: Iterable[tuple[str, Frame]] = ()) -> list[Command]:
        """Begin the round at ``now``; ``early`` are frames that arrived before."""
        for sender in self.last_from:
            self.last_from[sender] = now
        for r in self.last_progress:
            self.last_progress[r] = now
        for peer_id, declared in self.overweight.items():
            self._bad(
                peer_id, f"declared weight {declared:g} is over the bound of {self.weight_bound:g}"
            )
        my_parts = self.partition.parts_of(self.index)
        start, stop = self.partition.spans[self.index]
        if self.is_sender and self.weight > 0:
            # this peer's own values, before anything is sent: those of its span, or all of
            # them if it reduces nothing (the other reducers check what they receive, and
            # a reducer that excludes this peer says so: see _on_abort)
            mine = self.flat[start:stop] if my_parts else self.flat
            if not all_finite(mine):
                self._leave(BadContribution(self.me, None, "this peer's own values are not finite"))
                return self._flush()
        if self.reducer is None:
            for part in my_parts:  # nobody contributes: everyone keeps local values
                self.results.keep_local(part.view(self.flat))
        elif self.is_sender and my_parts:
            # this peer's own contribution to its span: every part at once (nothing has
            # arrived yet: frames that came early are handled below)
            own = self.flat[start:stop]
            finished = self.reducer.accumulate_range(self.me, 0, len(my_parts), own, self.weight)
            self._reject_bad()
            self._on_finished(finished)
        for sender, frame in early:
            self._on_frame(now, sender, frame)
        self._check_done()
        return self._flush()

    def on_frame(self, now: float, sender: str, frame: Frame) -> list[Command]:
        """A part, an average or an abort for this round from ``sender`` (decoding and
        in-place arithmetic only: a link reader may call this inline)."""
        self._on_frame(now, sender, frame)
        return self._flush()

    def next_send(self, peer_id: str) -> Send | Idle:
        """The next frame for ``peer_id`` (taken off its outbox), or why there is none."""
        if peer_id in self.failed or self.error is not None:
            return Idle.CLOSED
        return self.sending.next_send(peer_id)

    def sent(self, now: float, send: Send, error: str | None = None) -> list[Command]:
        """The transport took ``send`` (or, with ``error``, could not: the member is gone)."""
        r = self.peer_index[send.peer_id]
        if send.kind == "avg":
            for i in range(send.index, send.index + send.count):
                self.sending.release_wire(i)
        else:
            self.sending.contributing.discard(r)
            if error is None:
                self.last_progress[r] = now
        if error is not None:
            self._peer_failed(send.peer_id, f"cannot send to it: {error}")
        return self._flush()

    def unreachable(self, peer_id: str, error: str) -> list[Command]:
        """No link to ``peer_id`` could be opened: it is gone."""
        self._peer_failed(peer_id, f"cannot send to it: {error}")
        return self._flush()

    def tick(
        self,
        now: float,
        heard: Callable[[str], float] = _never,
        taken: Callable[[str], float] = _never,
    ) -> list[Command]:
        """Time passed: exclude the silent. ``heard(peer)`` is when bytes last came from a
        member, ``taken(peer)`` when the transport last took bytes for it (frames still
        under way count; 0.0: never)."""
        cfg = self.config
        reducer = self.reducer
        if reducer is not None and not reducer.is_finished:
            owing: set[Any] = set()
            for i in range(reducer.num_parts):
                owing |= reducer.waiting_for(i)
            for sender in owing - {self.me}:
                last = max(self.last_from[sender], heard(sender))
                if now - last > cfg.sender_timeout:
                    self._exclude_sender(sender, f"silent for {cfg.sender_timeout:g} s")
        for r, pending in self.unresolved.items():
            if not pending:
                continue
            peer_id = self.members[r].peer_id
            last = max(self.last_progress[r], heard(peer_id))
            # only while a contribution frame is under way to it do bytes the transport
            # takes count as a reducer's progress (it cannot average before it has them).
            # Bytes of averages, or of a frame into an empty socket buffer once nothing is
            # owed, say nothing about whether the reducer is there.
            if r in self.sending.contributing:
                last = max(last, taken(peer_id))
            if now - last > cfg.reducer_timeout:
                self._fail_reducer(r, f"silent for {cfg.reducer_timeout:g} s")
        return self._flush()

    def finish(self) -> None:
        """The round is over (done, timed out or cancelled): write the averages still held
        (:class:`~peer.averaging.allreduce.results.RoundResults`) and drop the encoded ones."""
        self.sending.wire_cache.clear()
        self.results.finish()

    # ----------------------------------------------------------------- reports

    def abort_frame(self, reason: str) -> Frame:
        """The notice this member sends when it leaves the round."""
        return Frame(ABORT, {"p": self.prefix, "g": self.group.group_id, "why": reason[:200]})

    @property
    def others_present(self) -> list[str]:
        """The other members not excluded."""
        return [p for p in self.sending.outboxes if p not in self.failed]

    @property
    def contributors(self) -> set[str]:
        """Members none of whose roles failed (for logging and tests)."""
        return set(self.peer_index) - self.failed

    @property
    def left(self) -> set[str]:
        """Members that left the round as far as this one can tell: excluded in both roles,
        or reducers that failed (silent for ``reducer_timeout``) before every average of
        their span came. Their spans kept this member's own values, and another member may
        have had every average of them in time, so the members' results can differ where
        this set is not empty (a sender excluded for its silence is not here: each
        reducer sends every member the same average, without it)."""
        return self.failed | {self.members[r].peer_id for r in self.failed_reducers}

    @property
    def offenders(self) -> frozenset[str]:
        """Members excluded for what they sent or declared (their spans keep the local
        values), as opposed to members that left or fell silent."""
        return frozenset(self._logged)

    # ------------------------------------------------------------------ output

    def _wake(self, peer_id: str) -> None:
        self._wakes[peer_id] = None

    def _flush(self) -> list[Command]:
        commands: list[Command] = [Wake(p) for p in self._wakes]
        commands += self._commands
        self._wakes.clear()
        self._commands = []
        return commands

    # -------------------------------------------------------------- receiving

    def _on_frame(self, now: float, sender: str, frame: Frame) -> None:
        if sender not in self.peer_index or sender == self.me or sender in self.failed:
            return
        if self.error is not None:
            return  # this peer is leaving the round
        if frame.type == PART:
            self._on_part(now, sender, frame)
        elif frame.type == AVERAGE:
            self._on_average(now, sender, frame)
        elif frame.type == ABORT:
            self._on_abort(sender, frame.fields.get("why", ""))

    def _on_part(self, now: float, sender: str, frame: Frame) -> None:
        reducer = self.reducer
        if reducer is None or sender not in reducer.senders:
            self._bad(sender, "sent a part although it is not a sender to this peer")
            return
        if sender in reducer.excluded:
            return
        index, count = frame.fields["i"], frame.fields.get("k", 1)
        try:
            sizes = batch_sizes(reducer.part_sizes, index, count)
            values = contribution_values(frame, sizes, count, self.flat.dtype)
            finished = reducer.accumulate_range(sender, index, count, values, frame.fields["w"])
            self._on_received_parts(sender, index, count)
        except (BadContribution, CompressionError, ValueError, RuntimeError) as exc:
            self._bad(sender, str(exc))
            return
        self.last_from[sender] = now
        self._accepted[sender] += count
        complete = self._accepted[sender] == reducer.num_parts
        if complete and self.in_place:
            # its values in parts still open are checked now rather than when those parts
            # complete: its averages need not be held until then (RoundResults)
            finished += reducer.vouch(sender)
        self._reject_bad()  # NaN/Inf found in parts this frame completed, or by vouch()
        if complete and sender not in self.failed:
            self.results.trust(self.peer_index[sender])
        self._on_finished(finished)

    def _reject_bad(self) -> None:
        assert self.reducer is not None
        for offence in self.reducer.take_rejected():
            if offence.sender != self.me:  # own values are checked before the round
                self._bad(offence.sender, str(offence))  # type: ignore[arg-type]
        for sender, index, ratio in self.reducer.take_outliers():
            if sender not in self._outliers_named:  # once per round and sender
                self._outliers_named.add(str(sender))
                logger.warning(
                    "the contribution of %s to part %d lies %.3g times the group's median "
                    "distance (or the average's norm) from the %s average: its pull on "
                    "the result was bounded",
                    sender,
                    index,
                    ratio,
                    self.config.aggregator,
                )

    def _on_received_parts(self, sender: str, index: int, count: int) -> None:
        """Hook for fault-injection tests; does nothing here."""

    def _on_average(self, now: float, sender: str, frame: Frame) -> None:
        r = self.peer_index[sender]
        pending = self.unresolved.get(r)
        if pending is None:
            return  # the reducer already failed
        parts = self.partition.parts_of(r)
        index, count = frame.fields["i"], frame.fields.get("k", 1)
        try:
            sizes = batch_sizes(self._sizes[r], index, count)
            average = average_values(frame, sizes, count, self.flat.dtype)
            if average is not None and self.config.aggregator != "mean":
                check_plausible(average, self.flat, parts[index].start, self.config.aggregator)
                if self._pair:  # (parts already written hold results, not own values)
                    base = parts[index].start
                    slots = [
                        (p.start - base, p.start, p.stop)
                        for i, p in enumerate(parts[index : index + count], index)
                        if i in pending
                    ]
                    check_pair(average, self.flat, slots)
        except (CompressionError, ValueError, RuntimeError) as exc:
            self._bad(sender, f"bad average: {exc}")
            return
        # runs of consecutive parts still pending (late or duplicate ones are skipped): one
        # write each
        base = parts[index].start
        run_start: int | None = None
        for i in range(index, index + count + 1):
            if i < index + count and i in pending:
                pending.discard(i)
                if run_start is None:
                    run_start = i
                continue
            if run_start is not None:
                lo, hi = parts[run_start].start, parts[i - 1].stop
                view = self.flat[lo:hi]
                if average is None:
                    self.results.keep_local(view)  # no contributor with positive weight
                else:
                    self.results.place(r, view, average[lo - base : hi - base])
                run_start = None
        self.last_progress[r] = now
        if not pending:
            self._wake(sender)
        self._check_done()

    def _on_finished(self, finished: list[FinishedPart]) -> None:
        if not finished:
            return
        in_place_already = self.reducer is not None and self.reducer.destination is not None
        sending = self.sending
        for done in finished:
            if done.average is None:
                self.results.keep_local(self.partition.part(self.index, done.index).view(self.flat))
                sending.hold_average(done.index, None, b"")
            elif self._plain[self.index][done.index]:
                if not in_place_already:  # else the reducer divided it into place
                    view = self.partition.part(self.index, done.index).view(self.flat)
                    self.results.write(view, done.average.to(view.dtype))
                # compressed when first sent alone (a batch sends the averages as they are)
                sending.hold_average(done.index, NOT_YET, b"")
            else:
                # a lossy codec: this peer keeps what the others decode, not its exact
                # average, so every member of the round ends with the same values
                part = self.partition.part(self.index, done.index)
                view = part.view(self.flat)
                compressed = part.codec.compress(done.average.to(view.dtype))
                sent = extract(compressed, check_finite=False).to(view.dtype)
                if in_place_already:
                    view.copy_(sent)
                else:
                    self.results.write(view, sent)
                header, payload = compressed.to_wire()
                sending.hold_average(done.index, header, payload)
            self.finished[done.index] = done
        indices = [done.index for done in finished]
        for peer_id, box in self.sending.outboxes.items():
            if peer_id in self.failed:
                for index in indices:
                    self.sending.release_wire(index)
                continue
            box.averages.extend(indices)
            self._wake(peer_id)
        if self.reducer is not None and self.reducer.is_finished:
            for peer_id in self.sending.outboxes:
                self._wake(peer_id)
        self._check_done()

    def _check_done(self) -> None:
        if self.done:
            return
        if self.reducer is not None and not self.reducer.is_finished:
            return
        if any(self.unresolved.values()):
            return
        self.done = True
        self._commands.append(Done())
        for peer_id in self.sending.outboxes:
            self._wake(peer_id)
