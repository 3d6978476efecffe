"""The bulk lane protocol as a machine, without sockets: tickets, the admission of a
connection from its first byte, the dialer's offer, and each end's framing, fed whole, in
pieces, truncated, oversize, forged and replayed."""

from __future__ import annotations

import random
from collections.abc import Iterator

import pytest

from peer.exceptions import FrameTooLarge, ProtocolError
from peer.transport.lane_protocol import (
    BULK_TICKET_OK,
    CLOSED,
    MAGIC,
    PROOF_BYTES,
    TICKET_BYTES,
    Admission,
    Admitted,
    LaneFraming,
    Refused,
    TicketBook,
    TicketOffer,
    preamble,
    register,
)
from peer.transport.secure import LaneKeys, SessionKeys
from peer.wire import INT, Frame, Limits, MessageRegistry, Schema

BLOB = "test.blob"
OTHER = "test.other"
SESSION = SessionKeys(send=bytes(32), recv=bytes(range(32)), lanes=bytes(range(1, 33)))
LIMITS = Limits(max_header_bytes=1 << 10, max_payload_bytes=1 << 16)


def _counter() -> Iterator[bytes]:
    n = 0
    while True:
        n += 1
        yield n.to_bytes(TICKET_BYTES, "big")


def book(ttl: float = 30.0, per_peer: int = 8, limit: int = 4096) -> TicketBook:
    """A ticket book whose tickets are 1, 2, 3... (distinct, as random ones are)."""
    tickets = _counter()
    return TicketBook(
        ttl=ttl, per_peer=per_peer, limit=limit, random_bytes=lambda size: next(tickets)[:size]
    )


def admit(tickets: TicketBook, data: bytes, now: float = 0.0, piece: int = 0) -> Admission:
    """An admission fed ``data`` (in ``piece``-byte pieces, or what it wants at a time)."""
    admission = Admission(tickets)
    while data and admission.wanted():
        size = min(piece or admission.wanted(), admission.wanted())
        admission.receive(data[:size], now)
        data = data[size:]
    return admission


# ---------------------------------------------------------------------------- tickets


def test_a_ticket_is_taken_once_and_only_before_it_expires() -> None:
    tickets = book(ttl=30.0)
    first = tickets.issue("alice", None, now=0.0)
    second = tickets.issue("alice", None, now=0.0)
    assert len(first) == TICKET_BYTES and first != second and len(tickets) == 2
    claim = tickets.take(first, now=30.0)
    assert claim is not None and claim.peer_id == "alice" and claim.keys is None
    assert tickets.take(first, now=30.0) is None  # replayed
    assert tickets.take(second, now=30.5) is None  # expired
    assert tickets.take(bytes(TICKET_BYTES), now=0.0) is None  # forged
    assert len(tickets) == 0


def test_a_ticket_on_an_encrypted_link_carries_the_lanes_keys() -> None:
    tickets = book()
    ticket = tickets.issue("alice", SESSION, now=0.0)
    claim = tickets.take(ticket, now=0.0)
    assert claim is not None and claim.keys == SESSION.lane(ticket)
    assert SESSION.lane(ticket) != SESSION.lane(bytes(TICKET_BYTES))


def test_nobody_holds_every_ticket_and_expired_ones_make_room() -> None:
    tickets = book(per_peer=2, limit=3)
    tickets.issue("alice", None, now=0.0)
    tickets.issue("alice", None, now=0.0)
    with pytest.raises(ValueError, match="2 bulk tickets of yours are outstanding"):
        tickets.issue("alice", None, now=0.0)
    tickets.issue("bob", None, now=0.0)
    with pytest.raises(ValueError, match="too many bulk tickets outstanding"):
        tickets.issue("carol", None, now=0.0)
    assert len(tickets.issue("carol", None, now=100.0)) == TICKET_BYTES  # the rest expired
    assert len(tickets) == 1


def test_a_ticket_is_never_issued_twice() -> None:
    tickets = TicketBook(random_bytes=lambda size: bytes(size))
    tickets.issue("alice", None, now=0.0)
    with pytest.raises(ValueError, match="no fresh ticket"):
        tickets.issue("bob", None, now=0.0)


# -------------------------------------------------------------------------- admission


@pytest.mark.parametrize("piece", [0, 1, 3])
def test_a_valid_preamble_admits_the_tickets_peer_in_any_pieces(piece: int) -> None:
    tickets = book()
    clear = tickets.issue("alice", None, now=0.0)
    admission = admit(tickets, preamble(clear, None), piece=piece)
    assert admission.decision == Admitted("alice", None) and admission.wanted() == 0
    sealed = tickets.issue("bob", SESSION, now=0.0)
    keys = SESSION.lane(sealed)
    data = preamble(sealed, keys)
    assert len(data) == len(MAGIC) + TICKET_BYTES + PROOF_BYTES
    assert admit(tickets, data, piece=piece).decision == Admitted("bob", keys)


def test_the_admission_waits_for_the_whole_preamble_and_reads_no_further() -> None:
    tickets = book()
    ticket = tickets.issue("alice", SESSION, now=0.0)
    admission = Admission(tickets)
    assert admission.wanted() == len(MAGIC) + TICKET_BYTES
    assert admission.receive(MAGIC, now=0.0) is None
    assert admission.wanted() == TICKET_BYTES
    assert admission.receive(ticket, now=0.0) is None
    assert admission.wanted() == PROOF_BYTES  # the proof follows an encrypted link's ticket
    with pytest.raises(ValueError, match="33 bytes given, 32 wanted"):
        admission.receive(bytes(PROOF_BYTES + 1), now=0.0)  # a lane's first frame: not its own
    decision = admission.receive(SESSION.lane(ticket).proof, now=0.0)
    assert isinstance(decision, Admitted)
    with pytest.raises(ValueError, match="decided"):
        admission.receive(b"x", now=0.0)


def test_a_bad_or_late_ticket_is_refused() -> None:
    tickets = book(ttl=30.0)
    valid = tickets.issue("alice", None, now=0.0)
    expired = tickets.issue("alice", None, now=0.0)
    cases = {
        "wrong magic": b"HTTP" + valid,  # uses the valid ticket up
        "used": MAGIC + valid,
        "forged": MAGIC + bytes(TICKET_BYTES),
        "expired": MAGIC + expired,
    }
    for case, data in cases.items():
        decision = admit(tickets, data, now=31.0 if case == "expired" else 0.0).decision
        assert decision == Refused("without a valid ticket"), case


def test_a_stolen_ticket_without_the_lanes_keys_is_refused() -> None:
    tickets = book()
    for proof in (bytes(PROOF_BYTES), SESSION.lane(bytes(TICKET_BYTES)).proof):
        ticket = tickets.issue("alice", SESSION, now=0.0)
        decision = admit(tickets, MAGIC + ticket + proof).decision
        assert decision == Refused("without proof of the link's keys", "alice")
        # the ticket was used up: the right proof comes too late
        retry = admit(tickets, preamble(ticket, SESSION.lane(ticket))).decision
        assert retry == Refused("without a valid ticket")


def test_a_connection_that_ends_early_is_refused() -> None:
    tickets = book()
    silent = Admission(tickets)
    assert silent.closed() == Refused(CLOSED) and silent.wanted() == 0
    half = admit(tickets, MAGIC[:2])
    assert half.decision is None and half.wanted() == len(MAGIC) + TICKET_BYTES - 2
    assert half.receive(b"", now=0.0) == Refused(CLOSED)  # the socket gave nothing: closed
    ticket = tickets.issue("alice", SESSION, now=0.0)
    no_proof = admit(tickets, MAGIC + ticket + bytes(5))
    assert no_proof.decision is None
    assert no_proof.closed() == Refused("without proof of the link's keys", "alice")


# ------------------------------------------------------------------------ ticket offer


def test_a_ticket_offer_is_read_back_and_a_bad_one_is_refused() -> None:
    offer = TicketOffer(4100, bytes(range(TICKET_BYTES)))
    assert TicketOffer.from_frame(offer.frame()) == offer
    bad = {
        "short ticket": Frame(BULK_TICKET_OK, {"port": 4100, "ticket": b"short"}),
        "long ticket": Frame(BULK_TICKET_OK, {"port": 4100, "ticket": bytes(64)}),
        "no ticket": Frame(BULK_TICKET_OK, {"port": 4100}),
        "text ticket": Frame(BULK_TICKET_OK, {"port": 4100, "ticket": "x" * TICKET_BYTES}),
        "port zero": Frame(BULK_TICKET_OK, {"port": 0, "ticket": offer.ticket}),
        "port too high": Frame(BULK_TICKET_OK, {"port": 70000, "ticket": offer.ticket}),
        "another reply": Frame("test.other", {"port": 4100, "ticket": offer.ticket}),
    }
    for case, frame in bad.items():
        with pytest.raises(ProtocolError):
            TicketOffer.from_frame(frame)
            pytest.fail(case)


def test_the_ticket_messages_are_registered() -> None:
    registry = MessageRegistry()
    register(registry)
    assert BULK_TICKET_OK in registry and "bulk.ticket" in registry


# ---------------------------------------------------------------------------- framing


def registry() -> MessageRegistry:
    found = MessageRegistry()
    found.register(BLOB, Schema(required={"seq": INT}, payload=True))
    found.register(OTHER, Schema())
    return found


def take(size: int) -> memoryview:
    return memoryview(bytearray(size))


def ends(keys: LaneKeys | None, accepted: set[str]) -> tuple[LaneFraming, LaneFraming]:
    """The dialer's framing and the listener's."""
    dialer = LaneFraming(registry(), LIMITS, accepted, take, keys, dialer=True)
    listener = LaneFraming(registry(), LIMITS, accepted, take, keys, dialer=False)
    return dialer, listener


def sent(framing: LaneFraming, frame: Frame) -> bytes:
    size, batches = framing.encode(frame)
    data = b"".join(bytes(view) for batch in batches for view in batch)
    assert size <= len(data)
    return data


def received(framing: LaneFraming, data: bytes, rng: random.Random) -> list[Frame]:
    """The frames ``framing`` parses out of ``data`` given in random pieces."""
    stream, frames = framing.stream, []
    while data:
        view = stream.buffer()
        n = min(len(view), len(data), rng.randint(1, 700))
        view[:n] = data[:n]
        del view
        stream.received(n)
        data = data[n:]
        while (frame := stream.next_frame()) is not None:
            frames.append(frame)
    return frames


KEYS = {"clear": None, "sealed": SESSION.lane(bytes(TICKET_BYTES))}


@pytest.mark.parametrize("mode", list(KEYS))
def test_frames_cross_in_both_directions_in_any_pieces(mode: str) -> None:
    rng = random.Random(7)
    dialer, listener = ends(KEYS[mode], {BLOB})
    frames = [Frame(BLOB, {"seq": i}, rng.randbytes(rng.choice([0, 1, 5000]))) for i in range(6)]
    for a, b in ((dialer, listener), (listener, dialer)):
        got = received(b, b"".join(sent(a, f) for f in frames), rng)
        assert [(f.fields, bytes(f.payload)) for f in got] == [
            (f.fields, f.payload) for f in frames
        ]


def test_a_sealed_lane_hides_its_frames_and_each_direction_has_its_key() -> None:
    dialer, listener = ends(KEYS["sealed"], {BLOB})
    frame = Frame(BLOB, {"seq": 1}, b"secret payload")
    data = sent(dialer, frame)
    assert b"secret payload" not in data
    with pytest.raises(ProtocolError):  # the dialer's own records, read as the listener's
        received(ends(KEYS["sealed"], {BLOB})[0], data, random.Random(1))
    assert [bytes(f.payload) for f in received(listener, data, random.Random(1))] == [
        b"secret payload"
    ]


def test_an_oversize_frame_is_refused_before_any_byte() -> None:
    dialer, _ = ends(None, {BLOB})
    with pytest.raises(FrameTooLarge, match="payload over the limit"):
        dialer.encode(Frame(BLOB, {"seq": 1}, bytes(LIMITS.max_payload_bytes + 1)))
    with pytest.raises(FrameTooLarge, match="header over the limit"):
        dialer.encode(Frame(OTHER, {"pad": "x" * LIMITS.max_header_bytes}))


NOT_CARRIED = {
    "type": Frame(OTHER),
    "request": Frame(BLOB, {"seq": 1}, request_id=3),
    "reply": Frame(BLOB, {"seq": 1}, reply_to=2),
}


@pytest.mark.parametrize("mode", list(KEYS))
@pytest.mark.parametrize("case", list(NOT_CARRIED))
def test_frames_a_lane_does_not_carry_are_refused(mode: str, case: str) -> None:
    dialer, listener = ends(KEYS[mode], {BLOB})
    with pytest.raises(ProtocolError, match="not accepted on a bulk lane"):
        received(listener, sent(dialer, NOT_CARRIED[case]), random.Random(2))


def test_types_accepted_later_are_carried() -> None:
    accepted = {BLOB}
    dialer, listener = ends(None, accepted)
    accepted.add(OTHER)  # the accepted types are read at each frame
    [frame] = received(listener, sent(dialer, Frame(OTHER)), random.Random(2))
    assert frame.type == OTHER


@pytest.mark.parametrize("mode", list(KEYS))
def test_a_truncated_frame_is_no_frame(mode: str) -> None:
    dialer, listener = ends(KEYS[mode], {BLOB})
    data = sent(dialer, Frame(BLOB, {"seq": 1}, bytes(3000)))
    assert received(listener, data[:-1], random.Random(3)) == []
    assert not listener.stream.pending


def test_a_replayed_or_altered_sealed_record_is_refused() -> None:
    for attack in ("replay", "alter"):
        dialer, listener = ends(KEYS["sealed"], {BLOB})
        first = sent(dialer, Frame(BLOB, {"seq": 1}, b"one"))
        second = bytearray(first if attack == "replay" else sent(dialer, Frame(BLOB, {"seq": 2})))
        if attack == "alter":
            second[-1] ^= 1  # one bit of the record's tag
        assert len(received(listener, first, random.Random(4))) == 1
        with pytest.raises(ProtocolError, match="failed authentication"):
            received(listener, bytes(second), random.Random(4))
