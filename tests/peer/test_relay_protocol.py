"""The relay's protocol without sockets: control framing, hellos, and the book of
registrations, circuits and limits (tickets, caps, rates), driven with explicit times."""

from __future__ import annotations

import msgpack
import pytest

from peer.exceptions import MalformedFrame, RelayRefused
from peer.transport.base import source_of
from peer.transport.relay import parse_relay_address, relay_address
from peer.transport.relay_protocol import (
    HELLO,
    ControlReader,
    Party,
    RelayBook,
    RelayLimits,
    TokenBucket,
    check_hello,
    decode_control,
    encode_control,
    hello_payload,
)

A, B, C = ("a" * 32), ("b" * 32), ("c" * 32)


def party(
    peer_id: str, run: str = "run", account: str | None = None, expires: float = 1e9
) -> Party:
    return Party(peer_id, run, account or peer_id, expires)


def test_control_messages_round_trip_through_exact_reads() -> None:
    stream = encode_control("incoming", ticket=b"t" * 16, **{"from": A}) + encode_control("ping")
    reader, got, pos = ControlReader(), [], 0
    while pos < len(stream):
        n = reader.needed()
        message = reader.feed(stream[pos : pos + n])
        pos += n
        if message is not None:
            got.append(message)
    assert got == [("incoming", {"ticket": b"t" * 16, "from": A}), ("ping", {})]
    with pytest.raises(ValueError, match="exactly"):
        ControlReader().feed(b"\x00")


@pytest.mark.parametrize(
    ("body", "match"),
    [
        (b"\xc1", "not valid msgpack"),
        (msgpack.packb([1, 2]), "a map with a type"),
        (msgpack.packb({"t": "connect", "host": "10.0.0.1"}), "unknown relay control"),
        (msgpack.packb({"t": "ping", "extra": 1}), "needs fields"),
        (msgpack.packb({"t": "refused", "reason": 3}), "must be str"),
        (msgpack.packb({"t": "challenge", "nonce": b"n", "v": True}), "must be int"),
    ],
)
def test_malformed_control_messages_are_refused(body: bytes, match: str) -> None:
    with pytest.raises(MalformedFrame, match=match):
        decode_control(body)


def test_an_oversized_control_message_is_refused_before_reading_it() -> None:
    with pytest.raises(MalformedFrame, match="of 65535 bytes"):
        ControlReader().feed(b"\xff\xff")
    with pytest.raises(ValueError, match="at most"):
        encode_control("refused", reason="x" * 9000)


def hello(kind: str, arg: bytes) -> dict[str, object]:
    body = encode_control(HELLO, kind=kind, key=b"k" * 32, cert=b"c", sig=b"s" * 64, arg=arg)
    return decode_control(body[2:])[1]


def test_a_hello_names_a_peer_id_or_a_ticket_never_an_address() -> None:
    check_hello(hello("dial", B.encode()))
    check_hello(hello("accept", b"t" * 16))
    check_hello(hello("listen", b""))
    for kind, arg, match in (
        ("dial", b"127.0.0.1:22", "names a peer id"),
        ("accept", b"short", "ticket"),
        ("listen", b"x", "no argument"),
        ("connect", b"", "asks for"),
    ):
        with pytest.raises(MalformedFrame, match=match):
            check_hello(hello(kind, arg))


def test_the_signed_hello_binds_nonce_kind_and_argument() -> None:
    base = hello_payload(b"n" * 32, "dial", B.encode())
    assert base != hello_payload(b"m" * 32, "dial", B.encode())
    assert base != hello_payload(b"n" * 32, "listen", B.encode())
    assert base != hello_payload(b"n" * 32, "dial", C.encode())


def test_relay_addresses() -> None:
    assert relay_address("relay://relay.example:4100", A) == f"relay://relay.example:4100/{A}"
    parsed = parse_relay_address(f"relay://[::1]:4100/{A}")
    assert (parsed.host, parsed.port, parsed.peer_id, parsed.relay) == (
        "::1",
        4100,
        A,
        "relay://[::1]:4100",
    )
    for bad in ("ws://h:1", "relay://h", "relay://h:1/not-a-peer", "relay://h:1/?q=1"):
        with pytest.raises(ValueError):
            parse_relay_address(bad)


# ------------------------------------------------------------------------------ the book


def test_a_circuit_needs_a_registered_target_of_the_same_run_and_its_ticket() -> None:
    book = RelayBook()
    with pytest.raises(RelayRefused, match="not registered"):
        book.dial(party(A), B, 0.0)
    book.register(party(B), 0.0)
    with pytest.raises(RelayRefused, match="not registered"):
        book.dial(party(A, run="other"), B, 0.0)
    with pytest.raises(RelayRefused, match="itself"):
        book.dial(party(B), B, 0.0)
    circuit = book.dial(party(A), B, 0.0)
    with pytest.raises(RelayRefused, match="issued to another peer"):
        book.accept(circuit.ticket, party(C), 1.0)
    with pytest.raises(RelayRefused, match="no circuit waits"):
        book.accept(b"x" * 16, party(B), 1.0)
    assert book.accept(circuit.ticket, party(B), 1.0) is circuit and circuit.open
    with pytest.raises(RelayRefused, match="no circuit waits"):  # single use
        book.accept(circuit.ticket, party(B), 1.0)


def test_an_unanswered_circuit_expires_and_frees_its_places() -> None:
    book = RelayBook(RelayLimits(max_circuits_per_peer=1, accept_timeout=10))
    book.register(party(B), 0.0)
    circuit = book.dial(party(A), B, 0.0)
    with pytest.raises(RelayRefused, match="limit of 1 circuits"):
        book.dial(party(A), B, 1.0)
    _, late = book.expire(11.0)
    assert late == [circuit]
    with pytest.raises(RelayRefused, match="no circuit waits"):
        book.accept(circuit.ticket, party(B), 11.0)
    book.dial(party(A), B, 11.0)  # the place is free again


def test_circuit_caps_per_account_and_in_all() -> None:
    d = "d" * 32
    book = RelayBook(RelayLimits(max_circuits=3, max_circuits_per_peer=2))
    for peer in (A, B, C, d):
        book.register(party(peer), 0.0)
    book.dial(party(A), B, 0.0)
    book.dial(party(A), C, 0.0)
    with pytest.raises(RelayRefused, match="your account holds its limit of 2"):
        book.dial(party(A), d, 0.0)
    book.dial(party(B), C, 0.0)
    with pytest.raises(RelayRefused, match="limit of 3 circuits"):
        book.dial(party(d), B, 0.0)
    assert book.stats()["circuits_pending"] == 3
    book = RelayBook(RelayLimits(max_circuits=10, max_circuits_per_peer=1))
    for peer in (B, C):
        book.register(party(peer), 0.0)
    book.dial(party(A), B, 0.0)
    with pytest.raises(RelayRefused, match=f"peer {B}'s account holds its limit of 1"):
        book.dial(party(C), B, 0.0)


def test_one_volunteers_keys_share_one_account() -> None:
    book = RelayBook(RelayLimits(max_circuits_per_peer=1))
    book.register(party(B), 0.0)
    book.register(party(C), 0.0)
    book.dial(party(A, account="alice"), B, 0.0)
    with pytest.raises(RelayRefused, match="your account holds its limit of 1"):
        book.dial(party("d" * 32, account="alice"), C, 0.0)


def test_the_relay_is_full_for_new_peers_but_not_for_a_reconnecting_one() -> None:
    book = RelayBook(RelayLimits(max_peers=1))
    first = party(A)
    assert book.register(first, 0.0) is None
    with pytest.raises(RelayRefused, match="full"):
        book.register(party(B), 0.0)
    again = party(A)
    assert book.register(again, 1.0) is first
    book.unregister(first)  # the old connection's end does not drop the new registration
    assert book.registered[A] is again


def test_an_expired_certificate_unregisters() -> None:
    book = RelayBook()
    book.register(party(B, expires=100.0), 0.0)
    expired, _ = book.expire(101.0)
    assert [p.peer_id for p in expired] == [B] and not book.registered


def test_byte_cap_refuses_past_it_and_says_when_again() -> None:
    book = RelayBook(RelayLimits(byte_cap=1000, cap_window=60, rate=1e9, burst=1e9))
    book.register(party(B), 0.0)
    circuit = book.dial(party(A), B, 0.0)
    book.accept(circuit.ticket, party(B), 0.0)
    book.charge(circuit, party(A), 600, 1.0)
    book.charge(circuit, party(B), 900, 1.0)  # the other side has its own allowance
    with pytest.raises(RelayRefused, match=r"cap of 1000 bytes .* again in 59 s"):
        book.charge(circuit, party(A), 600, 1.0)
    with pytest.raises(RelayRefused, match="cap of 1000 bytes"):
        book.charge(circuit, party(A), 1, 2.0)  # a refusal spends the rest of the window
    with pytest.raises(RelayRefused, match="cap of 1000 bytes"):
        book.dial(party(A), B, 3.0)  # and no new circuit either
    book.close(circuit)
    book.dial(party(A), B, 61.0)  # a new window
    assert book.bytes_carried == 1500 and circuit.sent == {A: 600, B: 900}


def test_room_is_what_a_sender_may_still_send_in_its_window() -> None:
    book = RelayBook(RelayLimits(byte_cap=1000, cap_window=60, rate=1e9, burst=1e9))
    book.register(party(B), 0.0)
    circuit = book.dial(party(A), B, 0.0)
    book.accept(circuit.ticket, party(B), 0.0)
    assert book.room(party(A), 0.0) == 1000
    book.charge(circuit, party(A), book.room(party(A), 1.0), 1.0)  # up to the cap exactly
    assert book.room(party(A), 1.0) == 0 and book.room(party(B), 1.0) == 1000
    with pytest.raises(RelayRefused, match="cap of 1000 bytes"):
        book.charge(circuit, party(A), 1, 2.0)
    assert book.room(party(A), 61.0) == 1000  # a new window
    assert book.bytes_carried == 1000


def test_the_rate_holds_a_sender_back_by_the_excess() -> None:
    bucket = TokenBucket(rate=1000, burst=500, now=0.0)
    assert bucket.take(500, 0.0) == 0.0
    assert bucket.take(250, 0.0) == pytest.approx(0.25)
    assert bucket.take(0, 0.25) == 0.0  # paid back after the wait
    assert bucket.take(1000, 10.0) == pytest.approx(0.5)  # a long pause refills only the burst


def test_charge_returns_the_wait_of_the_senders_rate() -> None:
    book = RelayBook(RelayLimits(rate=1000, burst=1000))
    book.register(party(B), 0.0)
    circuit = book.dial(party(A), B, 0.0)
    book.accept(circuit.ticket, party(B), 0.0)
    assert book.charge(circuit, party(A), 1000, 0.0) == 0.0
    assert book.charge(circuit, party(A), 2000, 0.0) == pytest.approx(2.0)
    assert book.charge(circuit, party(B), 1000, 0.0) == 0.0


@pytest.mark.parametrize(
    "kwargs",
    [{"max_peers": 0}, {"rate": 0}, {"byte_cap": 0}, {"cap_window": -1}, {"accept_timeout": 0}],
)
def test_limits_are_checked(kwargs: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        RelayLimits(**kwargs)  # type: ignore[arg-type]


def test_a_relayed_connection_counts_as_its_dialer_not_as_the_relay() -> None:
    """Per-source handshake limits: peers behind one relay are not one source."""
    relay = "relay://198.51.100.7:4100"
    assert source_of(f"{relay}/{A}") != source_of(f"{relay}/{B}")
    assert source_of(f"{relay}/{A}") != source_of("ws://198.51.100.7:50312")
