"""What a peer publishes about itself under the membership key: where to dial it, whether
it is in client mode, whether it is leaving: how a node writes its own record, the checks
every peer applies to a membership record before it is stored, and the live members a store's
records name."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from peer.formats.identity import Identity
from peer.node.gossip import MEMBERS_KEY, Record, RecordError, unpack_value

__all__ = [
    "MAX_ADDRESSES",
    "MAX_ADDRESS_CHARS",
    "Member",
    "announced_addresses",
    "decode_member",
    "live_members",
    "member_record",
]

MAX_ADDRESSES = 16  # per membership record
MAX_ADDRESS_CHARS = 256


@dataclass(frozen=True, slots=True)
class Member:
    peer_id: str
    addresses: tuple[str, ...]
    client_mode: bool
    expiration: float
    leaving: bool = False  # announced a clean shutdown; kept out of members()


def decode_member(record: Record) -> tuple[tuple[str, ...], bool, bool]:
    """A membership record's ``(addresses, client_mode, leaving)``; :class:`RecordError`
    for one that is malformed."""
    try:
        value = unpack_value(record.value)
    except Exception as exc:
        raise RecordError("membership record is not valid msgpack") from exc
    if not isinstance(value, dict):
        raise RecordError("membership record must be a map")
    addresses = value.get("addresses")
    client_mode = value.get("client_mode")
    leaving = value.get("leaving", False)
    if (
        not isinstance(addresses, list)
        or len(addresses) > MAX_ADDRESSES
        or not all(isinstance(a, str) and len(a) <= MAX_ADDRESS_CHARS for a in addresses)
        or not isinstance(client_mode, bool)
        or not isinstance(leaving, bool)
    ):
        raise RecordError("membership record has bad addresses or client_mode")
    return tuple(addresses), client_mode, leaving


def member_record(
    identity: Identity,
    addresses: Sequence[str],
    client_mode: bool,
    expiration: float,
    seq: int,
    *,
    leaving: bool = False,
) -> Record:
    """``identity``'s membership record (what :func:`decode_member` reads back); a leaving
    one names no address."""
    value: dict[str, object] = {"addresses": [] if leaving else list(addresses)}
    value["client_mode"] = client_mode
    if leaving:
        value["leaving"] = True
    return Record.create(identity, MEMBERS_KEY, identity.peer_id, value, expiration, seq=seq)


def live_members(
    records: Iterable[Record], cache: dict[bytes, Member]
) -> tuple[dict[str, Member], dict[bytes, Member]]:
    """The members that ``records`` (membership records) name, leaving ones and malformed
    records left out, and the cache of decoded records to pass to the next call (each
    record is decoded once, keyed by its signature)."""
    out: dict[str, Member] = {}
    kept: dict[bytes, Member] = {}
    for record in records:
        member = cache.get(record.signature)
        if member is None:
            try:
                addresses, client_mode, leaving = decode_member(record)
            except RecordError:
                continue
            member = Member(record.owner_id, addresses, client_mode, record.expiration, leaving)
        kept[record.signature] = member
        if not member.leaving:
            out[member.peer_id] = member
    return out, kept


def announced_addresses(addresses: Sequence[str], client_mode: bool) -> list[str]:
    """The addresses a node may announce, checked: ``TypeError`` for a bare string,
    ``ValueError`` for a client-mode node (nobody can dial it) or addresses over the limits."""
    if isinstance(addresses, str):
        raise TypeError('addresses is a list, e.g. ["ws://203.0.113.7:4000"]')
    announced = [str(a) for a in addresses]
    if client_mode and announced:
        raise ValueError("a client-mode node accepts no connections: it has no address")
    if len(announced) > MAX_ADDRESSES or any(
        not a or len(a) > MAX_ADDRESS_CHARS for a in announced
    ):
        raise ValueError(
            f"announce at most {MAX_ADDRESSES} addresses of 1 to {MAX_ADDRESS_CHARS} characters"
        )
    return announced
