"""The bulk lane protocol without I/O: tickets, a lane's opening preamble, its framing.

A lane opens with a *ticket*: the dialer asks the listener over their authenticated link
(``bulk.ticket``), the listener's :class:`TicketBook` issues one (16 random bytes, single
use, valid :data:`TICKET_TTL` seconds, bound to the dialer's peer id) and the dialer sends
:func:`preamble` (magic, ticket and, on an encrypted link, the proof that it holds the lane's
keys) as the first bytes of the TCP connection. The listener feeds those bytes to an
:class:`Admission`, which ends in :class:`Admitted` (the peer the lane belongs to) or
:class:`Refused`. :class:`LaneFraming` then turns frames into the bytes one end sends and
the bytes received into frames (sealed with the lane's keys, or in clear).

Everything here takes bytes and the time and returns bytes and decisions: the sockets, the
event loop and the timeouts are :mod:`peer.transport.bulk`'s.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Collection, Iterator
from dataclasses import dataclass

from peer.exceptions import FrameTooLarge, ProtocolError
from peer.transport.lane_stream import LaneReader
from peer.transport.secure import LaneKeys, LaneOpener, LaneSealer, SessionKeys, lane_proof_ok
from peer.wire import (
    BYTES,
    INT,
    LENGTH_BYTES,
    Frame,
    Header,
    Limits,
    MessageRegistry,
    Schema,
    encode_header,
)

__all__ = [
    "BULK_TICKET",
    "BULK_TICKET_OK",
    "Admission",
    "Admitted",
    "LaneFraming",
    "Refused",
    "TicketBook",
    "TicketOffer",
    "preamble",
    "register",
]

BULK_TICKET = "bulk.ticket"
BULK_TICKET_OK = "bulk.ticket_ok"
MAGIC = b"SWGB"  # "swarmgrad bulk", version 1 of the lane preamble
TICKET_BYTES = 16
PROOF_BYTES = 32  # after the ticket on an encrypted lane: the dialer holds the lane's keys
TICKET_TTL = 30.0
MAX_TICKETS_PER_PEER = 8  # unused tickets one peer may hold (a lane or two takes one each)
MAX_TICKETS = 4096  # unused tickets in all
CLOSED = "closed during the preamble"  # a refusal that is no attempt (nothing to log)


def register(registry: MessageRegistry) -> None:
    """Register the ticket request and its reply (they travel over links)."""
    registry.register(BULK_TICKET, Schema())
    registry.register(BULK_TICKET_OK, Schema(required={"port": INT, "ticket": BYTES}))


# ---------------------------------------------------------------------- tickets


@dataclass(frozen=True, slots=True)
class Claim:
    """What a ticket stands for: the peer it was issued to, until when, the lane's keys."""

    peer_id: str
    expiry: float
    keys: LaneKeys | None  # None on a link in clear


class TicketBook:
    """The listener's outstanding tickets: issued to authenticated peers, each taken once."""

    def __init__(
        self,
        *,
        ttl: float = TICKET_TTL,
        per_peer: int = MAX_TICKETS_PER_PEER,
        limit: int = MAX_TICKETS,
        random_bytes: Callable[[int], bytes] = os.urandom,
    ) -> None:
        self._ttl = ttl
        self._per_peer = per_peer
        self._limit = limit
        self._random_bytes = random_bytes
        self._claims: dict[bytes, Claim] = {}

    def __len__(self) -> int:
        return len(self._claims)

    def issue(self, peer_id: str, session: SessionKeys | None, now: float) -> bytes:
        """A new ticket for ``peer_id`` (whose link has ``session``'s keys). ValueError when
        that peer, or everyone together, holds too many unused ones."""
        for ticket, claim in list(self._claims.items()):
            if claim.expiry < now:
                del self._claims[ticket]
        if len(self._claims) >= self._limit:
            raise ValueError("too many bulk tickets outstanding")
        held = sum(claim.peer_id == peer_id for claim in self._claims.values())
        if held >= self._per_peer:  # nobody takes every ticket and locks others out
            raise ValueError(f"{held} bulk tickets of yours are outstanding: use them first")
        ticket = self._random_bytes(TICKET_BYTES)
        if len(ticket) != TICKET_BYTES or ticket in self._claims:
            raise ValueError("no fresh ticket")
        keys = session.lane(ticket) if session is not None else None
        self._claims[ticket] = Claim(peer_id, now + self._ttl, keys)
        return ticket

    def take(self, ticket: bytes, now: float) -> Claim | None:
        """The claim of ``ticket``, once (None: unknown, already used or expired)."""
        claim = self._claims.pop(ticket, None)
        return claim if claim is not None and claim.expiry >= now else None


@dataclass(frozen=True, slots=True)
class TicketOffer:
    """A listener's reply to a ticket request: where to dial, and what to show."""

    port: int
    ticket: bytes

    @classmethod
    def from_frame(cls, frame: Frame) -> TicketOffer:
        """Read a ``bulk.ticket_ok`` reply; ProtocolError for one no lane can open with."""
        port, ticket = frame.fields.get("port"), frame.fields.get("ticket")
        if frame.type != BULK_TICKET_OK or not isinstance(port, int) or not 0 < port < 65536:
            raise ProtocolError(f"not a bulk ticket offer: {frame.type} port={port!r}")
        if not isinstance(ticket, bytes) or len(ticket) != TICKET_BYTES:
            raise ProtocolError(f"a bulk ticket is {TICKET_BYTES} bytes")
        return cls(port, ticket)

    def frame(self) -> Frame:
        return Frame(BULK_TICKET_OK, {"port": self.port, "ticket": self.ticket})


def preamble(ticket: bytes, keys: LaneKeys | None) -> bytes:
    """The dialer's first bytes on a lane: magic, ticket, and the proof on an encrypted one."""
    return MAGIC + ticket + (keys.proof if keys is not None else b"")


# -------------------------------------------------------------------- admission


@dataclass(frozen=True, slots=True)
class Admitted:
    """The connection is a lane of ``peer_id`` (sealed with ``keys`` unless None)."""

    peer_id: str
    keys: LaneKeys | None


@dataclass(frozen=True, slots=True)
class Refused:
    """The connection is no lane: close it. ``peer_id`` is the ticket's, if it had one."""

    reason: str
    peer_id: str | None = None


class Admission:
    """One connection to the lane port, from its first byte to :class:`Admitted` or
    :class:`Refused`. Feed it at most :meth:`wanted` bytes at a time (what follows the
    preamble is the lane's), and :meth:`closed` when the connection ends or times out."""

    def __init__(self, book: TicketBook) -> None:
        self._book = book
        self._got = bytearray()
        self._claim: Claim | None = None
        self.decision: Admitted | Refused | None = None

    def wanted(self) -> int:
        """Bytes still needed before the next step (0 once decided)."""
        if self.decision is not None:
            return 0
        if self._claim is None:
            return len(MAGIC) + TICKET_BYTES - len(self._got)
        return PROOF_BYTES - len(self._got)

    def receive(self, data: bytes, now: float) -> Admitted | Refused | None:
        """Take bytes the connection gave; the decision once there is one."""
        if self.decision is not None:
            raise ValueError("the admission is decided")
        if not data:
            return self.closed()
        if len(data) > self.wanted():
            raise ValueError(f"{len(data)} bytes given, {self.wanted()} wanted")
        self._got += data
        if self.wanted():
            return None
        if self._claim is None:
            return self._ticket(bytes(self._got), now)
        keys = self._claim.keys
        assert keys is not None
        if lane_proof_ok(keys, bytes(self._got)):
            return self._decide(Admitted(self._claim.peer_id, keys))
        return self._decide(Refused("without proof of the link's keys", self._claim.peer_id))

    def closed(self) -> Admitted | Refused:
        """The connection ended (or went silent too long) before a decision."""
        if self.decision is None:
            claim = self._claim
            self.decision = (
                Refused(CLOSED)
                if claim is None
                else Refused("without proof of the link's keys", claim.peer_id)
            )
        return self.decision

    def _ticket(self, got: bytes, now: float) -> Admitted | Refused | None:
        claim = self._book.take(got[len(MAGIC) :], now)  # used up, even with the wrong magic
        if got[: len(MAGIC)] != MAGIC or claim is None:
            return self._decide(Refused("without a valid ticket"))
        if claim.keys is None:
            return self._decide(Admitted(claim.peer_id, None))
        self._claim, self._got = claim, bytearray()
        return None

    def _decide(self, decision: Admitted | Refused) -> Admitted | Refused:
        self.decision = decision
        return decision


# ---------------------------------------------------------------------- framing


class LaneFraming:
    """One end of a lane: frames to the bytes it sends, bytes received to frames.

    Only frames of the ``accepted`` types (one-way: no request id, no reply) may arrive;
    anything else, or a malformed stream, is a :class:`~peer.exceptions.ProtocolError`
    from :attr:`stream`. ``take(size)`` gives the buffer a payload is received into."""

    def __init__(
        self,
        registry: MessageRegistry,
        limits: Limits,
        accepted: Collection[str],
        take: Callable[[int], memoryview],
        keys: LaneKeys | None,
        *,
        dialer: bool,
    ) -> None:
        self.limits = limits
        self._accepted = accepted  # read at each frame: types accepted later count
        self._sealer: LaneSealer | None = None
        self.stream: LaneOpener | LaneReader
        if keys is not None:
            mine, theirs = (keys.dialer, keys.listener) if dialer else (keys.listener, keys.dialer)
            self._sealer = LaneSealer(mine)
            self.stream = LaneOpener(theirs, registry, limits, check=self.check, take=take)
        else:
            self.stream = LaneReader(registry, limits, check=self.check, take=take)

    def check(self, head: Header) -> None:
        """ProtocolError for a header that may not travel on a lane."""
        if head.type not in self._accepted or head.request_id or head.reply_to:
            raise ProtocolError(f"{head.type!r} is not accepted on a bulk lane")

    def encode(self, frame: Frame) -> tuple[int, Iterator[list[memoryview]]]:
        """The frame's size in bytes, and the batches of views to send in turn. Raises
        FrameTooLarge, before anything is sent, for a frame the other end would refuse."""
        header = encode_header(frame)
        payload = memoryview(frame.payload).cast("B")
        limits = self.limits
        if payload.nbytes > limits.max_payload_bytes:
            raise FrameTooLarge(
                f"{frame.type}: payload over the limit of {limits.max_payload_bytes} bytes"
            )
        if len(header) - LENGTH_BYTES > limits.max_header_bytes:
            raise FrameTooLarge(
                f"{frame.type}: header over the limit of {limits.max_header_bytes} bytes"
            )
        size = len(header) + payload.nbytes
        if self._sealer is not None:
            # sealed in batches of records into one reused buffer, each sent in turn
            return size, self._sealer.seal(header, payload)
        views = [memoryview(header), payload] if payload.nbytes else [memoryview(header)]
        return size, iter([views])
