"""The relay's protocol without I/O: control messages and their framing, what a peer signs
to prove its key, and the relay's book of registrations, circuits and limits.

A relay (:mod:`peer.transport.relay_server`) splices TCP streams between two peers of a run
that cannot dial each other; :mod:`peer.transport.relay` is the peers' side. Each TCP
connection starts with the relay's ``challenge`` (a fresh nonce), the peer's ``hello``
(``kind``: ``listen``, ``dial`` or ``accept`` with its argument; its key, run certificate and
signature over :func:`hello_payload`) and the relay's ``ok`` or ``refused``. A ``listen``
connection stays open as the peer's control connection (``incoming``, ``ping``); a ``dial``
makes the relay send the dialed peer ``incoming``, which opens an ``accept`` connection with
the ticket, and the relay copies bytes between the two. From then on the bytes are the
ordinary sealed link's: the relay sees sizes and timing only.

Control messages are ``u16 length ‖ msgpack map`` (at most :data:`MAX_CONTROL_BYTES`).
"""

from __future__ import annotations

import math
import os
import struct
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TypedDict, cast

import msgpack

from peer.exceptions import MalformedFrame, RelayRefused
from peer.formats.identity import PUBLIC_KEY_SIZE, SIGNATURE_SIZE, is_peer_id

__all__ = [
    "CHALLENGE",
    "HELLO",
    "KINDS",
    "MAX_CONTROL_BYTES",
    "Circuit",
    "ControlFields",
    "ControlReader",
    "Party",
    "RelayBook",
    "RelayLimits",
    "TokenBucket",
    "decode_control",
    "encode_control",
    "hello_payload",
]

VERSION = 1
MAX_CONTROL_BYTES = 8 * 1024  # a hello with a certificate takes under 1 KiB
NONCE_BYTES = 32
TICKET_BYTES = 16
_LENGTH = struct.Struct(">H")
_CONTEXT = b"swarmgrad/relay-hello/v1\x00"

# message types
CHALLENGE = "challenge"  # relay → peer: {nonce, v}
HELLO = "hello"  # peer → relay: {kind, key, cert, sig, target | ticket}
OK = "ok"  # relay → peer
REFUSED = "refused"  # relay → peer: {reason}; the relay closes the connection
INCOMING = "incoming"  # relay → listening peer: {ticket, from}
PING = "ping"  # relay → listening peer, which answers PONG
PONG = "pong"
NOTICE = "notice"  # relay → listening peer: {text} (a circuit closed at a limit, ...)

LISTEN, DIAL, ACCEPT = "listen", "dial", "accept"
KINDS = (LISTEN, DIAL, ACCEPT)

# a control message's fields, each of the type _FIELDS gives for its message type
ControlFields = TypedDict(
    "ControlFields",
    {
        "nonce": bytes,
        "v": int,
        "kind": str,
        "key": bytes,
        "cert": bytes,
        "sig": bytes,
        "arg": bytes,
        "reason": str,
        "ticket": bytes,
        "from": str,
        "text": str,
    },
    total=False,
)

_FIELDS: dict[str, dict[str, type]] = {
    CHALLENGE: {"nonce": bytes, "v": int},
    HELLO: {"kind": str, "key": bytes, "cert": bytes, "sig": bytes, "arg": bytes},
    OK: {},
    REFUSED: {"reason": str},
    INCOMING: {"ticket": bytes, "from": str},
    PING: {},
    PONG: {},
    NOTICE: {"text": str},
}


def encode_control(message_type: str, **fields: object) -> bytes:
    """One framed control message."""
    body: bytes = msgpack.packb({"t": message_type, **fields}, use_bin_type=True)
    if len(body) > MAX_CONTROL_BYTES:
        raise ValueError(f"a relay control message is at most {MAX_CONTROL_BYTES} bytes")
    return _LENGTH.pack(len(body)) + body


def decode_control(body: bytes) -> tuple[str, ControlFields]:
    """The type and fields of one control message's body; :class:`MalformedFrame` for
    anything but a known type with exactly its fields, of their types."""
    try:
        raw = msgpack.unpackb(body, raw=False, strict_map_key=True, max_bin_len=MAX_CONTROL_BYTES)
    except Exception as exc:
        raise MalformedFrame(f"a relay control message is not valid msgpack: {exc}") from None
    if not isinstance(raw, dict) or not isinstance(raw.get("t"), str):
        raise MalformedFrame("a relay control message is a map with a type 't'")
    message_type = raw.pop("t")
    expected = _FIELDS.get(message_type)
    if expected is None:
        raise MalformedFrame(f"unknown relay control message {message_type!r}")
    if set(raw) != set(expected):
        raise MalformedFrame(
            f"relay {message_type!r} needs fields {sorted(expected)}, not {sorted(raw)}"
        )
    for name, kind in expected.items():
        if not isinstance(raw[name], kind) or isinstance(raw[name], bool):
            raise MalformedFrame(f"relay {message_type!r}: {name!r} must be {kind.__name__}")
    return message_type, cast(ControlFields, raw)  # its fields and their types checked above


class ControlReader:
    """Splits a byte stream into control messages (no I/O): :meth:`needed` says how many
    bytes to read next, exactly, so that nothing after a message is taken from the stream
    (after ``ok`` the stream is the spliced link's)."""

    def __init__(self) -> None:
        self._length: int | None = None

    def needed(self) -> int:
        return _LENGTH.size if self._length is None else self._length

    def feed(self, data: bytes) -> tuple[str, ControlFields] | None:
        """Take exactly :meth:`needed` bytes; a message once its body is complete."""
        if len(data) != self.needed():
            raise ValueError(f"feed exactly {self.needed()} bytes, not {len(data)}")
        if self._length is None:
            (length,) = _LENGTH.unpack(data)
            if not 0 < length <= MAX_CONTROL_BYTES:
                raise MalformedFrame(f"a relay control message of {length} bytes")
            self._length = length
            return None
        self._length = None
        return decode_control(data)


def hello_payload(nonce: bytes, kind: str, arg: bytes) -> bytes:
    """What a peer signs in its hello: this connection's nonce, what it asks and of whom.
    So a recorded hello is worth nothing on another connection, and a certificate alone
    proves nothing."""
    signed: bytes = msgpack.packb([nonce, kind, arg], use_bin_type=True)
    return _CONTEXT + signed


def check_hello(fields: ControlFields) -> None:
    """Shape checks of a hello's fields, before any signature is verified."""
    if fields["kind"] not in KINDS:
        raise MalformedFrame(f"a relay hello asks for {fields['kind']!r}, not one of {KINDS}")
    if len(fields["key"]) != PUBLIC_KEY_SIZE or len(fields["sig"]) != SIGNATURE_SIZE:
        raise MalformedFrame("a relay hello carries a 32-byte key and a 64-byte signature")
    arg = fields["arg"]
    if fields["kind"] == DIAL and not is_peer_id(arg.decode("ascii", "replace")):
        raise MalformedFrame("a relay dial names a peer id")
    if fields["kind"] == ACCEPT and len(arg) != TICKET_BYTES:
        raise MalformedFrame(f"a relay accept carries a {TICKET_BYTES}-byte ticket")
    if fields["kind"] == LISTEN and arg:
        raise MalformedFrame("a relay listen carries no argument")


# --------------------------------------------------------------------------- limits


@dataclass(frozen=True, slots=True)
class RelayLimits:
    """What one relay carries at most. A peer's bytes are what it sends through the relay;
    they count against its *account*: the volunteer its certificate names (so one person's
    several keys share one allowance), else its peer id."""

    max_peers: int = 1024  # peers registered (control connections) at once
    max_circuits: int = 256  # circuits open or being opened, in all
    max_circuits_per_peer: int = 16  # ... with one account at either end
    rate: float = 4 * 2**20  # bytes/s one account may send through the relay
    burst: float = 4 * 2**20  # bytes it may send at once before the rate holds it back
    byte_cap: int = 4 * 2**30  # bytes one account may send per window
    cap_window: float = 3600.0  # seconds
    accept_timeout: float = 10.0  # for a dialed peer to open its side of a circuit

    def __post_init__(self) -> None:
        if min(self.max_peers, self.max_circuits, self.max_circuits_per_peer) < 1:
            raise ValueError("max_peers, max_circuits and max_circuits_per_peer must be >= 1")
        if self.rate <= 0 or self.burst < 1 or self.byte_cap < 1 or self.cap_window <= 0:
            raise ValueError("rate, burst, byte_cap and cap_window must be positive")
        if self.accept_timeout <= 0:
            raise ValueError("accept_timeout must be positive")


class TokenBucket:
    """Bytes per second with a burst (no clock of its own: every call gives ``now``)."""

    def __init__(self, rate: float, burst: float, now: float) -> None:
        self.rate = rate
        self.burst = burst
        self.tokens = burst
        self.at = now

    def take(self, n: int, now: float) -> float:
        """Take ``n`` bytes' worth; the seconds to wait before sending more (0 if none)."""
        self.tokens = min(self.burst, self.tokens + (now - self.at) * self.rate)
        self.at = now
        self.tokens -= n
        return 0.0 if self.tokens >= 0 else -self.tokens / self.rate


@dataclass(frozen=True, slots=True)
class Party:
    """An authenticated end of a relay connection."""

    peer_id: str
    run_id: str
    account: str  # whose allowance its bytes and circuits count against
    expires_at: float  # its certificate's expiry (with the relay's skew tolerance)


@dataclass(slots=True)
class _Account:
    bucket: TokenBucket
    window_start: float
    window_bytes: int = 0
    circuits: int = 0  # open or being opened, at either end

    def idle(self, now: float, window: float) -> bool:
        return not self.circuits and now - self.window_start >= window


@dataclass(slots=True, eq=False)
class Circuit:
    """Two peers' streams spliced by the relay (or about to be: ``open`` is False until the
    dialed peer accepted)."""

    ticket: bytes
    dialer: Party
    target: Party
    expires_at: float  # for the target to accept, while not open
    open: bool = False
    sent: dict[str, int] = field(default_factory=dict)  # peer id → bytes it sent

    @property
    def bytes_carried(self) -> int:
        return sum(self.sent.values())


class RelayBook:
    """Registrations, circuits and each account's allowance (no I/O, no clock: every call
    that needs the time is given ``now``).

    Refusals raise :class:`~peer.exceptions.RelayRefused` with the reason for the peer."""

    def __init__(self, limits: RelayLimits | None = None) -> None:
        self.limits = limits or RelayLimits()
        self.registered: dict[str, Party] = {}  # peer id → its registration
        self.circuits: dict[bytes, Circuit] = {}  # ticket → circuit (open or pending)
        self._accounts: dict[str, _Account] = {}
        self.bytes_carried = 0  # by every circuit so far, both directions
        self.circuits_opened = 0
        self.refusals = 0

    # registering ----------------------------------------------------------------------------

    def register(self, party: Party, now: float) -> Party | None:
        """Register ``party`` (reachable through this relay from now on); the registration it
        replaces (the same peer, reconnected), whose control connection is to be closed."""
        previous = self.registered.get(party.peer_id)
        if previous is None and len(self.registered) >= self.limits.max_peers:
            raise self._refuse(
                f"this relay is full ({self.limits.max_peers} peers registered): "
                "try another relay, or later"
            )
        self.registered[party.peer_id] = party
        return previous

    def unregister(self, party: Party) -> None:
        """``party``'s control connection ended (a newer registration stays)."""
        if self.registered.get(party.peer_id) is party:
            del self.registered[party.peer_id]

    def expire(self, now: float) -> tuple[list[Party], list[Circuit]]:
        """Registrations whose certificate expired (their control connections are to be
        closed) and circuits whose target did not accept in time (dropped here)."""
        parties = [p for p in self.registered.values() if p.expires_at < now]
        for party in parties:
            del self.registered[party.peer_id]
        late = [c for c in self.circuits.values() if not c.open and c.expires_at < now]
        for circuit in late:
            self.close(circuit)
        for name, account in list(self._accounts.items()):
            if account.idle(now, self.limits.cap_window):
                del self._accounts[name]
        return parties, late

    # circuits -------------------------------------------------------------------------------

    def dial(self, dialer: Party, target_id: str, now: float) -> Circuit:
        """A new circuit from ``dialer`` to the registered peer ``target_id``, waiting for the
        target to accept (its ticket goes to the target's control connection)."""
        limits = self.limits
        target = self.registered.get(target_id)
        if target is None or target.run_id != dialer.run_id or target.expires_at < now:
            raise self._refuse(
                f"peer {target_id} is not registered with this relay (it may have left, or "
                "registered with another relay)"
            )
        if target_id == dialer.peer_id:
            raise self._refuse("a peer cannot dial itself through a relay")
        if len(self.circuits) >= limits.max_circuits:
            raise self._refuse(
                f"this relay carries its limit of {limits.max_circuits} circuits: try later"
            )
        for party, whose in ((dialer, "your"), (target, f"peer {target_id}'s")):
            account = self._account(party.account, now)
            if account.circuits >= limits.max_circuits_per_peer:
                raise self._refuse(
                    f"{whose} account holds its limit of {limits.max_circuits_per_peer} "
                    "circuits through this relay"
                )
        self._check_cap(dialer, now)
        ticket = os.urandom(TICKET_BYTES)
        circuit = Circuit(ticket, dialer, target, now + limits.accept_timeout)
        self.circuits[ticket] = circuit
        for name in {dialer.account, target.account}:
            self._accounts[name].circuits += 1
        return circuit

    def accept(self, ticket: bytes, acceptor: Party, now: float) -> Circuit:
        """The target's side of the circuit ``ticket``: the circuit, now open."""
        circuit = self.circuits.get(ticket)
        if circuit is None or circuit.open or circuit.expires_at < now:
            raise self._refuse("no circuit waits for this ticket (it expired, or was used)")
        if acceptor.peer_id != circuit.target.peer_id or acceptor.run_id != circuit.target.run_id:
            raise self._refuse("this ticket was issued to another peer")
        self._check_cap(acceptor, now)
        circuit.open = True
        self.circuits_opened += 1
        return circuit

    def charge(self, circuit: Circuit, sender: Party, n: int, now: float) -> float:
        """``sender`` sends ``n`` bytes over ``circuit``: the seconds to wait before the next
        bytes (its rate). :class:`RelayRefused` when they would pass its byte cap (the
        circuit is then to be closed; the bytes are not sent)."""
        account = self._check_cap(sender, now, n)
        account.window_bytes += n
        circuit.sent[sender.peer_id] = circuit.sent.get(sender.peer_id, 0) + n
        self.bytes_carried += n
        return account.bucket.take(n, now)

    def room(self, sender: Party, now: float) -> int:
        """How many bytes ``sender`` may still send before its byte cap (0: none; its next
        bytes are refused). A relay reads no more than this at a time, so that a sender is
        carried up to its cap exactly, whatever chunks its bytes arrive in."""
        account = self._account(sender.account, now)
        if now - account.window_start >= self.limits.cap_window:
            return self.limits.byte_cap
        return max(0, self.limits.byte_cap - account.window_bytes)

    def close(self, circuit: Circuit) -> None:
        """``circuit`` ended (or never opened): its places are free again."""
        if self.circuits.pop(circuit.ticket, None) is None:
            return
        for name in {circuit.dialer.account, circuit.target.account}:
            account = self._accounts.get(name)
            if account is not None:
                account.circuits -= 1

    # accounts -------------------------------------------------------------------------------

    def _account(self, name: str, now: float) -> _Account:
        account = self._accounts.get(name)
        if account is None:
            bucket = TokenBucket(self.limits.rate, self.limits.burst, now)
            account = self._accounts[name] = _Account(bucket, now)
        return account

    def _check_cap(self, party: Party, now: float, n: int = 0) -> _Account:
        limits = self.limits
        account = self._account(party.account, now)
        if now - account.window_start >= limits.cap_window:
            account.window_start, account.window_bytes = now, 0
        if account.window_bytes + n > limits.byte_cap or (
            not n and account.window_bytes >= limits.byte_cap
        ):
            # what it tried to send spends the rest: nothing more in this window
            account.window_bytes = limits.byte_cap
            again = math.ceil(account.window_start + limits.cap_window - now)
            raise self._refuse(
                f"account {party.account} sent its cap of {limits.byte_cap} bytes through "
                f"this relay in {limits.cap_window:g} s; it may again in {again} s"
            )
        return account

    def _refuse(self, reason: str) -> RelayRefused:
        self.refusals += 1
        return RelayRefused(reason)

    def accounts(self) -> Iterator[tuple[str, int, int]]:
        """(account, bytes sent in its current window, circuits) for each account."""
        for name, account in self._accounts.items():
            yield name, account.window_bytes, account.circuits

    def stats(self) -> dict[str, int]:
        """What the relay carries now and has carried (for its log, its stats file, benches)."""
        return {
            "peers": len(self.registered),
            "circuits": sum(c.open for c in self.circuits.values()),
            "circuits_pending": sum(not c.open for c in self.circuits.values()),
            "circuits_opened": self.circuits_opened,
            "bytes_carried": self.bytes_carried,
            "refusals": self.refusals,
        }
