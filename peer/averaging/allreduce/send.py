"""The sending side of a butterfly round: what goes in the next frame to a member.

Each other member has an :class:`Outbox`: the contributions this member still owes it and
the averages of this member's span not yet sent to it. :class:`RoundSending` (owned by
:class:`~peer.averaging.allreduce.round.ButterflyRound` as ``round.sending``) turns the head of an
outbox into a frame on :meth:`RoundSending.next_send`: contributions first, then averages.

Uncompressed payloads are zero-copy slices of the flat buffer or the reducer's results; an
average is encoded once and kept in a wire cache until every member took it. Consecutive
uncompressed parts ready for one member go out as one frame of up to
:attr:`RoundSending.max_batch_bytes` (field ``k``: how many parts from ``i``). No I/O.
"""

from __future__ import annotations

import collections
from collections.abc import Mapping
from typing import TypeAlias

import torch

from peer.averaging.allreduce.partition import Partition
from peer.averaging.allreduce.reducer import FinishedPart, WeightedMeanReducer
from peer.averaging.allreduce.vocabulary import Idle, Send
from peer.averaging.matchmaking.messages import GroupInfo
from peer.averaging.protocol import AVERAGE, PART
from peer.compression import NoCompression, byte_view, dtype_name
from peer.wire import Frame

__all__ = ["NOT_YET", "Outbox", "RoundSending"]

Payload: TypeAlias = bytes | bytearray | memoryview  # a frame's raw payload

NOT_YET: dict[str, object] = {}  # a wire cache entry whose average is not compressed yet


class Outbox:
    """What this member still has to send one other member, by part index."""

    __slots__ = ("averages", "contributions")

    def __init__(self) -> None:
        self.averages: collections.deque[int] = collections.deque()
        self.contributions: collections.deque[int] = collections.deque()


class RoundSending:
    """Frames out of a round's state (the rules are below), owned by a
    :class:`~peer.averaging.allreduce.round.ButterflyRound`. Fault-injection tests subclass it,
    overriding :meth:`_frame` and :meth:`_contribution_wire` to misbehave, and make it a
    round's ``sending_class``.

    Each other member has an outbox (:class:`Outbox`): the indices of the contributions this member
    still owes it (parts of that member's span) and of the averages of this member's own span not
    yet sent to it. What to send next to a member is pulled, not pushed:
    :meth:`RoundSending.next_send` takes the head of its outbox (contributions first, then averages
    as they are ready) and turns it into a frame. :class:`RoundSending` is a collaborator that
    :class:`~peer.averaging.allreduce.round.ButterflyRound` owns (``round.sending``): it is given
    what it reads (the round's plan, flat buffer, reducer and the containers of finished parts and
    unresolved or failed reducers, which the round fills) and owns the outboxes, the wire cache and
    the set of reducers a contribution is under way to.

    Payloads are views of the flat buffer or of the reducer's results (``NoCompression`` is
    zero-copy): uncompressed frames are slices of byte views taken once per round. An average
    of this member's span is encoded once, when first sent alone, and kept in a wire cache
    until every member it goes to took it (or left).

    Batching: consecutive uncompressed parts that are ready for the same member at once (all
    of a member's contributions are, at the start) go out as one frame of up to
    :attr:`RoundSending.max_batch_bytes` (field ``k``: how many parts, from ``i`` on): the
    receiver handles them part by part, but per-frame costs (system calls, wake-ups, headers)
    are paid once per batch. Parts stay the unit of reduction, exclusion and fault handling.
    """

    #: consecutive uncompressed parts sent as one frame, up to this many bytes (0: never)
    max_batch_bytes = 2 << 20

    def __init__(
        self,
        *,
        prefix: str,
        group: GroupInfo,
        index: int,
        peer_index: Mapping[str, int],
        flat: torch.Tensor,
        weight: float,
        partition: Partition,
        sizes: list[list[int]],
        plain: list[list[bool]],
        reducer: WeightedMeanReducer | None,
        finished: Mapping[int, FinishedPart],
        unresolved: Mapping[int, set[int]],
        failed_reducers: set[int],
        is_sender: bool,
    ) -> None:
        """``finished`` (this member's averages), ``unresolved`` (other reducers' parts
        still waiting for their average) and ``failed_reducers`` are the round's, read
        here as the round updates them."""
        self.prefix = prefix
        self.group = group
        self.index = index
        self.peer_index = peer_index
        self.flat = flat
        self.weight = weight
        self.partition = partition
        self._sizes = sizes
        self._plain = plain
        self.reducer = reducer
        self.finished = finished
        self.unresolved = unresolved
        self.failed_reducers = failed_reducers
        #: what this member still owes each other member, by peer id (members' order)
        self.outboxes: dict[str, Outbox] = {}
        for peer_id, r in peer_index.items():
            if r == index:
                continue
            box = self.outboxes[peer_id] = Outbox()
            if is_sender:
                box.contributions.extend(range(len(partition.parts_of(r))))
        #: reducers a contribution frame is being sent to right now (see the round's tick)
        self.contributing: set[int] = set()
        # averages of this member's span by part index: (header or NOT_YET or None for
        # "no average", payload, members still to take it)
        self.wire_cache: dict[int, tuple[dict[str, object] | None, Payload, int]] = {}
        # byte views: uncompressed frames are slices of these (no tensor views per frame)
        self._itemsize = flat.element_size()
        self._dtype_name = dtype_name(flat.dtype)
        self._flat_bytes = byte_view(flat)
        self._results_bytes: memoryview | None = None  # where own averages end up
        if reducer is not None:
            results = reducer.destination if reducer.destination is not None else reducer.buffer
            if results.dtype == flat.dtype:
                self._results_bytes = byte_view(results)

    def hold_average(self, index: int, header: dict[str, object] | None, payload: Payload) -> None:
        """Keep the wire form of this member's average of part ``index`` until every other
        member took it (``header``: :data:`NOT_YET` to compress it when first sent alone,
        None when the part has no average)."""
        self.wire_cache[index] = (header, payload, len(self.outboxes))

    def next_send(self, peer_id: str) -> Send | Idle:
        """The next frame for ``peer_id`` (taken off its outbox), or why there is none
        (the round answers for members that left, and once it is leaving itself)."""
        box = self.outboxes[peer_id]
        r = self.peer_index[peer_id]
        # contributions first: the member can then reduce (and trust this peer's averages,
        # see peer.averaging.allreduce.results) as early as possible
        pending = self.unresolved.get(r, set())
        while box.contributions and r not in self.failed_reducers:
            index = box.contributions.popleft()
            if index in pending:
                count = self._batch("part", r, index, box)
                self.contributing.add(r)
                return Send(peer_id, "part", index, count, self._frame("part", r, index, count))
        box.contributions.clear()
        if box.averages:
            index = box.averages.popleft()
            count = self._batch("avg", r, index, box)
            return Send(peer_id, "avg", index, count, self._frame("avg", r, index, count))
        if self.reducer is None or self.reducer.is_finished:
            return Idle.CLOSED
        return Idle.WAIT

    def _batch(self, kind: str, r: int, index: int, box: Outbox) -> int:
        """How many parts from ``index`` on go in this frame: take from the outbox the
        consecutive uncompressed parts that are ready, contiguous in memory, and fit in
        :attr:`max_batch_bytes` together."""
        if not self.max_batch_bytes:
            return 1
        owner = r if kind == "part" else self.index
        plain, sizes = self._plain[owner], self._sizes[owner]
        if not plain[index]:
            return 1
        if kind == "avg" and (self._results_bytes is None or self.finished[index].average is None):
            return 1
        queue = box.contributions if kind == "part" else box.averages
        pending = self.unresolved.get(r, set())
        limit = self.max_batch_bytes // self.flat.element_size()  # in elements
        numel, count = sizes[index], 1
        while queue and queue[0] == index + count:
            nxt = index + count
            if not plain[nxt] or numel + sizes[nxt] > limit:
                break
            if kind == "part" and nxt not in pending:
                break
            if kind == "avg" and self.finished[nxt].average is None:
                break
            queue.popleft()
            numel += sizes[nxt]
            count += 1
        return count

    def _frame(self, kind: str, r: int, index: int, count: int = 1) -> Frame:
        base = {"p": self.prefix, "g": self.group.group_id, "l": self.group.leader, "i": index}
        payload: Payload
        if count > 1:  # uncompressed, adjacent parts (see _batch)
            base["k"] = count
            if kind == "part":
                parts = self.partition.parts_of(r)
                header, payload = self._plain_wire(
                    self._flat_bytes, parts[index].start, parts[index + count - 1].stop
                )
                return Frame(PART, {**base, "w": self.weight, "c": header}, payload)
            assert self.reducer is not None and self._results_bytes is not None
            offsets = self.reducer.offsets
            header, payload = self._plain_wire(
                self._results_bytes, offsets[index], offsets[index + count]
            )
            return Frame(AVERAGE, {**base, "c": header}, payload)
        if kind == "part":
            header, payload = self._contribution_wire(r, index)
            return Frame(PART, {**base, "w": self.weight, "c": header}, payload)
        cached, payload, remaining = self.wire_cache[index]
        if cached is NOT_YET:
            average = self.finished[index].average
            assert average is not None and self.reducer is not None
            if self._plain[self.index][index] and self._results_bytes is not None:
                offsets = self.reducer.offsets
                cached, payload = self._plain_wire(
                    self._results_bytes, offsets[index], offsets[index + 1]
                )
            else:
                average = average.to(self.flat.dtype)
                part = self.partition.part(self.index, index)
                cached, payload = part.codec.compress(average).to_wire()
            self.wire_cache[index] = (cached, payload, remaining)
        if cached is None:
            return Frame(AVERAGE, base)
        return Frame(AVERAGE, {**base, "c": cached}, payload)

    def _contribution_wire(self, r: int, index: int) -> tuple[dict[str, object], Payload]:
        part = self.partition.part(r, index)
        if self._plain[r][index]:
            return self._plain_wire(self._flat_bytes, part.start, part.stop)
        return part.codec.compress(part.view(self.flat)).to_wire()

    def _plain_wire(
        self, data: memoryview, start: int, stop: int
    ) -> tuple[dict[str, object], Payload]:
        """An uncompressed payload: elements ``start..stop`` of ``data`` (a byte view of
        the flat buffer or of the reducer's results), with its ``none`` codec header."""
        size = self._itemsize
        header: dict[str, object] = {
            "codec": NoCompression.name,
            "dtype": self._dtype_name,
            "shape": [stop - start],
            "meta": {},
        }
        return header, data[start * size : stop * size]

    def release_wire(self, index: int) -> None:
        """One member took this member's average of part ``index`` (or left)."""
        header, payload, remaining = self.wire_cache[index]
        if remaining <= 1:
            del self.wire_cache[index]
        else:
            self.wire_cache[index] = (header, payload, remaining - 1)
