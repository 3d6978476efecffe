"""The replicated key → subkey → (value, expiration) store, without I/O.

Every record is signed by its owner (the peer that stored it). A record's slot is
``(key, subkey, owner)``: no other peer can overwrite it, and a relaying peer cannot alter
it without breaking the signature. Within a slot the newest expiration wins; across owners
of the same ``(key, subkey)`` a read returns the value with the newest expiration — the
"latest write wins" semantics that hivemind-style code expects from ``get``.

Anti-entropy (push-pull, Demers et al., 1987): the initiator sends a digest of
``(record id, expiration)`` pairs; the responder answers with the records the initiator
lacks or holds older copies of, and the ids it wants in return; the initiator pushes those.
This module computes digests and differences; :mod:`peer.node.core` moves the bytes.

Clock skew: expirations are absolute wall-clock times set by the owner. A record is
refused if it has already expired by the receiver's clock or expires more than
``max_ttl`` seconds in the future. A peer whose clock runs ``s`` seconds ahead therefore
makes its records live ``s`` seconds longer in others' eyes; one ``s`` seconds behind
makes them vanish ``s`` seconds early and, if ``s`` exceeds a record's time to live, never
accepted at all. With the default membership TTL (30 s) a few seconds of skew only shifts
when a dead peer disappears.
"""

from __future__ import annotations

import hashlib
import random
import struct
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Generic, NamedTuple, TypeVar

import msgpack

from peer.identity import Identity, peer_id_from_public_key, verify_signature

RECORD_CONTEXT = b"swarmgrad/record/v1\x00"
RECORD_ID_BYTES = 12
_DIGEST_ENTRY = struct.Struct(f">{RECORD_ID_BYTES}sd")  # record id, expiration
RESERVED_PREFIX = "_"
MEMBERS_KEY = "_members"

Subkey = str | int | bytes | None
T = TypeVar("T")


class ValueWithExpiration(NamedTuple, Generic[T]):
    """``value, expiration_time = node.get(key)``. For a key stored with subkeys, ``value``
    is a dict subkey → ValueWithExpiration and ``expiration_time`` the newest among them."""

    value: T
    expiration_time: float


class RecordError(ValueError):
    """A record is invalid: bad signature, bad fields, reserved key misuse."""


def pack_value(value: Any) -> bytes:
    """msgpack-encode a user value; raises TypeError for values msgpack cannot carry."""
    try:
        return msgpack.packb(value, use_bin_type=True)
    except (TypeError, ValueError, OverflowError) as exc:
        raise TypeError(
            f"gossip values must be msgpack-serialisable (dict, list, str, bytes, int, float, bool, None): {exc}"
        ) from None


def unpack_value(data: bytes) -> Any:
    return msgpack.unpackb(data, raw=False, strict_map_key=False)


@dataclass(frozen=True, slots=True)
class Record:
    key: str
    subkey: Subkey
    value: bytes  # msgpack-encoded user value (exactly the bytes that were signed)
    expiration: float
    owner: bytes  # owner's raw Ed25519 public key
    signature: bytes = field(default=b"", repr=False)

    @property
    def rid(self) -> bytes:
        """Identity of the record's slot: (key, subkey, owner)."""
        slot = msgpack.packb([self.key, self.subkey, self.owner], use_bin_type=True)
        return hashlib.blake2b(slot, digest_size=RECORD_ID_BYTES).digest()

    @property
    def owner_id(self) -> str:
        return peer_id_from_public_key(self.owner)

    def signed_bytes(self) -> bytes:
        body = msgpack.packb(
            [self.key, self.subkey, self.value, float(self.expiration), self.owner],
            use_bin_type=True,
        )
        return RECORD_CONTEXT + body

    @classmethod
    def create(
        cls, identity: Identity, key: str, subkey: Subkey, value: Any, expiration: float
    ) -> Record:
        unsigned = cls(key, subkey, pack_value(value), float(expiration), identity.public_key)
        return cls(
            key,
            subkey,
            unsigned.value,
            unsigned.expiration,
            unsigned.owner,
            identity.sign(unsigned.signed_bytes()),
        )

    def verify(self) -> None:
        """Raise :class:`RecordError` unless the owner's signature holds and reserved keys
        are used as their rules say (a membership record is about its owner only)."""
        if not verify_signature(self.owner, self.signature, self.signed_bytes()):
            raise RecordError(f"record {self.key!r} has an invalid signature")
        if self.key == MEMBERS_KEY and self.subkey != self.owner_id:
            raise RecordError("a membership record may only describe its owner")

    def to_wire(self) -> list[Any]:
        return [self.key, self.subkey, self.value, self.expiration, self.owner, self.signature]

    @classmethod
    def from_wire(cls, item: Any) -> Record:
        if not isinstance(item, list | tuple) or len(item) != 6:
            raise RecordError("a record is a list of 6 items")
        key, subkey, value, expiration, owner, signature = item
        if not isinstance(key, str) or not key or len(key) > 1024:
            raise RecordError("record key must be a non-empty string of at most 1024 characters")
        if subkey is not None and (
            isinstance(subkey, bool) or not isinstance(subkey, str | int | bytes)
        ):
            raise RecordError("record subkey must be a string, an integer, bytes or None")
        if (
            not isinstance(value, bytes)
            or not isinstance(owner, bytes)
            or not isinstance(signature, bytes)
        ):
            raise RecordError("record value, owner and signature must be bytes")
        if (
            isinstance(expiration, bool)
            or not isinstance(expiration, int | float)
            or expiration != expiration
        ):
            raise RecordError("record expiration must be a number")
        return cls(key, subkey, value, float(expiration), owner, signature)

    def newer_than(self, other: Record) -> bool:
        # Ties on expiration are broken by signature bytes so every peer picks the same copy.
        return (self.expiration, self.signature) > (other.expiration, other.signature)


class GossipStore:
    """Records by slot, with expiry. ``now`` is always passed in; nothing here reads a clock."""

    def __init__(self, *, max_ttl: float = 7 * 24 * 3600.0, max_records: int = 1_000_000) -> None:
        self.max_ttl = max_ttl
        self.max_records = max_records
        self._records: dict[bytes, Record] = {}
        self._by_key: dict[str, set[bytes]] = {}

    def __len__(self) -> int:
        return len(self._records)

    def put(self, record: Record, now: float) -> bool:
        """Insert ``record`` if it is live and newer than what its slot holds.

        Returns False when it was not stored (expired, too far in the future, or not newer).
        Signatures are the caller's business: :meth:`Record.verify` for remote records.
        """
        if record.expiration <= now or record.expiration > now + self.max_ttl:
            return False
        rid = record.rid
        existing = self._records.get(rid)
        if existing is not None and existing.expiration > now and not record.newer_than(existing):
            return False
        if existing is None and len(self._records) >= self.max_records:
            self.expire(now)
            if len(self._records) >= self.max_records:
                return False
        self._records[rid] = record
        self._by_key.setdefault(record.key, set()).add(rid)
        return True

    def get(self, key: str, now: float) -> ValueWithExpiration[Any] | None:
        live = [
            r
            for r in (self._records[rid] for rid in self._by_key.get(key, ()))
            if r.expiration > now
        ]
        if not live:
            return None
        with_subkeys = [r for r in live if r.subkey is not None]
        if not with_subkeys:
            best = max(live, key=lambda r: (r.expiration, r.signature))
            return ValueWithExpiration(unpack_value(best.value), best.expiration)
        by_subkey: dict[Any, Record] = {}
        for record in with_subkeys:
            current = by_subkey.get(record.subkey)
            if current is None or record.newer_than(current):
                by_subkey[record.subkey] = record
        value = {
            sk: ValueWithExpiration(unpack_value(r.value), r.expiration)
            for sk, r in by_subkey.items()
        }
        return ValueWithExpiration(value, max(r.expiration for r in by_subkey.values()))

    def records(self, key: str, now: float) -> list[Record]:
        """Every live record under ``key`` (all owners, all subkeys)."""
        return [
            r
            for r in (self._records[rid] for rid in self._by_key.get(key, ()))
            if r.expiration > now
        ]

    def expire(self, now: float) -> list[Record]:
        """Drop and return every record that has expired by ``now``."""
        gone = [r for r in self._records.values() if r.expiration <= now]
        for record in gone:
            rid = record.rid
            del self._records[rid]
            rids = self._by_key.get(record.key)
            if rids is not None:
                rids.discard(rid)
                if not rids:
                    del self._by_key[record.key]
        return gone

    # anti-entropy ------------------------------------------------------------------------

    def digest(self, now: float) -> bytes:
        """Every live record as (id, expiration), packed: 20 bytes a record, so a digest of
        thousands of records costs one buffer instead of thousands of msgpack objects."""
        pack = _DIGEST_ENTRY.pack
        return b"".join(
            pack(rid, r.expiration) for rid, r in self._records.items() if r.expiration > now
        )

    def compare(
        self, remote_digest: bytes | bytearray | memoryview, now: float
    ) -> tuple[list[Record], list[bytes]]:
        """Given the other side's digest: the records it lacks or holds older copies of, and
        the ids of records it holds that are missing or older here.

        Raises RecordError if the digest is not a whole number of entries."""
        if len(remote_digest) % _DIGEST_ENTRY.size:
            raise RecordError(f"a digest is a multiple of {_DIGEST_ENTRY.size} bytes")
        remote: dict[bytes, float] = {
            rid: expiration
            for rid, expiration in _DIGEST_ENTRY.iter_unpack(remote_digest)
            if expiration == expiration
        }
        theirs_newer: list[bytes] = []
        for rid, expiration in remote.items():
            if expiration <= now:
                continue
            mine = self._records.get(rid)
            if mine is None or mine.expiration < expiration:
                theirs_newer.append(rid)
        mine_newer = [
            r
            for rid, r in self._records.items()
            if r.expiration > now and (rid not in remote or remote[rid] < r.expiration)
        ]
        return mine_newer, theirs_newer

    def get_by_ids(self, rids: Iterable[bytes], now: float) -> list[Record]:
        out = []
        for rid in rids:
            record = self._records.get(bytes(rid))
            if record is not None and record.expiration > now:
                out.append(record)
        return out


def take_within_budget(records: list[Record], max_bytes: int, rng: random.Random) -> list[Record]:
    """A random subset of ``records`` whose encoded size stays under ``max_bytes``; the rest
    go in a later round. Membership records go first: they are how the swarm finds itself."""
    rng.shuffle(records)
    records.sort(key=lambda r: r.key != MEMBERS_KEY)
    out: list[Record] = []
    size = 0
    for record in records:
        cost = len(record.value) + len(record.key) + 128
        if size + cost > max_bytes and out:
            break
        out.append(record)
        size += cost
    return out
