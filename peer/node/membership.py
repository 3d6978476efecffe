"""What a peer publishes about itself under the membership key: where to dial it, whether
it is in client mode, whether it is leaving; and the checks every peer applies to a
membership record before it is stored."""

from __future__ import annotations

from dataclasses import dataclass

from peer.node.gossip import Record, RecordError, unpack_value

__all__ = ["MAX_ADDRESSES", "MAX_ADDRESS_CHARS", "Member", "decode_member"]

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
