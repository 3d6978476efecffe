"""The replicated key → subkey → (value, expiration) store, without I/O.

Every record is signed by its owner; its slot is ``(key, subkey, owner)``, so no other peer
can overwrite or alter it. Within a slot the owner's signed sequence number decides
(:func:`next_sequence`), so a relay resending an older copy never replaces a newer one;
across owners a read returns the newest expiration ("latest write wins"). A subkey that is a
peer id is that peer's alone. In certificate mode only owners with a valid run certificate
may hold records (:mod:`peer.node.certificates`).

Anti-entropy is push-pull (Demers et al., 1987): this module computes digests of ``(record
id, sequence number)`` and their differences; :mod:`peer.node.exchange` moves the bytes.
Expirations are the owner's wall-clock times: a record already expired, or expiring more
than ``max_ttl`` ahead, by the receiver's clock is refused, so clock skew only shifts when a
record vanishes.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import struct
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Generic, NamedTuple, TypeVar

import msgpack

from peer.formats.identity import (
    Identity,
    is_peer_id,
    peer_id_from_public_key,
    verify_signature,
)
from peer.formats.open_types import UserMetadata

RECORD_CONTEXT = b"swarmgrad/record/v2\x00"
RECORD_ID_BYTES = 12
_DIGEST_ENTRY = struct.Struct(f">{RECORD_ID_BYTES}sQ")  # record id, sequence number
DIGEST_ENTRY_BYTES = _DIGEST_ENTRY.size
MAX_SEQUENCE = (1 << 63) - 1
MAX_DIGEST_ENTRIES = 1 << 18  # entries of a peer's digest that a comparison reads
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


def pack_value(value: object) -> bytes:
    """msgpack-encode a user value; raises TypeError for values msgpack cannot carry."""
    try:
        packed: bytes = msgpack.packb(value, use_bin_type=True)
        return packed
    except (TypeError, ValueError, OverflowError) as exc:
        raise TypeError(
            f"gossip values must be msgpack-serialisable (dict, list, str, bytes, int, float, bool, None): {exc}"
        ) from None


def unpack_value(data: bytes) -> UserMetadata:
    return msgpack.unpackb(data, raw=False, strict_map_key=False)


def next_sequence(previous: int, now: float) -> int:
    """The sequence number of an owner's next record: one more than its previous one, or
    the wall clock in microseconds if that is larger. The clock part keeps the numbers
    growing across a restart with the same identity (the counter itself is not saved),
    unless the clock was set back by more than the peer was away."""
    return min(max(previous + 1, int(now * 1_000_000)), MAX_SEQUENCE)


def _slot_digest(key: str, subkey: Subkey, owner: bytes) -> bytes:
    slot = msgpack.packb([key, subkey, owner], use_bin_type=True)
    return hashlib.blake2b(slot, digest_size=RECORD_ID_BYTES).digest()


# Every gossip exchange asks for the slots of the records it carries: a peer sees the same
# few slots per member over and over. Only short slots are kept, and at most 8192 of them
# (a few MiB at worst), so a sender's long or ever-new keys cost it work, not our memory.
_slot_id = functools.lru_cache(maxsize=1 << 13, typed=True)(_slot_digest)
_CACHED_SLOT_CHARS = 320  # key, subkey and owner together


@dataclass(frozen=True, slots=True)
class Record:
    key: str
    subkey: Subkey
    value: bytes  # msgpack-encoded user value (exactly the bytes that were signed)
    expiration: float
    seq: int  # owner's sequence number: within a slot the larger one wins (next_sequence)
    owner: bytes  # owner's raw Ed25519 public key
    signature: bytes = field(default=b"", repr=False)

    @property
    def rid(self) -> bytes:
        """Identity of the record's slot: (key, subkey, owner)."""
        sub = len(self.subkey) if isinstance(self.subkey, str | bytes) else 0
        if len(self.key) + sub + len(self.owner) > _CACHED_SLOT_CHARS:
            return _slot_digest(self.key, self.subkey, self.owner)
        return _slot_id(self.key, self.subkey, self.owner)

    @property
    def owner_id(self) -> str:
        return peer_id_from_public_key(self.owner)

    def signed_bytes(self) -> bytes:
        body: bytes = msgpack.packb(
            [self.key, self.subkey, self.value, float(self.expiration), self.seq, self.owner],
            use_bin_type=True,
        )
        return RECORD_CONTEXT + body

    @classmethod
    def create(
        cls,
        identity: Identity,
        key: str,
        subkey: Subkey,
        value: object,
        expiration: float,
        *,
        seq: int,
    ) -> Record:
        """Sign a record. ``seq`` must be larger than that of every record ``identity``
        signed before (:func:`next_sequence`), or peers keep the earlier one."""
        if isinstance(seq, bool) or not isinstance(seq, int) or not 0 <= seq <= MAX_SEQUENCE:
            raise ValueError(f"seq must be an integer from 0 to {MAX_SEQUENCE}")
        unsigned = cls(key, subkey, pack_value(value), float(expiration), seq, identity.public_key)
        unsigned.check_subkey()
        return dataclasses.replace(unsigned, signature=identity.sign(unsigned.signed_bytes()))

    def verify(self) -> None:
        """Raise :class:`RecordError` unless the owner's signature holds and reserved keys
        are used as their rules say (a membership record is about its owner only)."""
        if not verify_signature(self.owner, self.signature, self.signed_bytes()):
            raise RecordError(f"record {self.key!r} has an invalid signature")
        if self.key == MEMBERS_KEY and self.subkey != self.owner_id:
            raise RecordError("a membership record may only describe its owner")
        self.check_subkey()

    def may_use_subkey(self) -> bool:
        return not is_peer_id(self.subkey) or self.subkey == self.owner_id

    def check_subkey(self) -> None:
        """A subkey that is a peer id belongs to that peer: only it may write there, so
        nobody can be read as another peer (progress, declarations, state donors)."""
        if not self.may_use_subkey():
            raise RecordError(
                f"peer {self.owner_id} wrote {self.key!r} under another peer's id {self.subkey!s}"
            )

    def to_wire(self) -> list[object]:
        return [
            self.key,
            self.subkey,
            self.value,
            self.expiration,
            self.seq,
            self.owner,
            self.signature,
        ]

    @classmethod
    def from_wire(cls, item: object) -> Record:
        if not isinstance(item, list | tuple) or len(item) != 7:
            raise RecordError("a record is a list of 7 items")
        key, subkey, value, expiration, seq, owner, signature = item
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
        if isinstance(seq, bool) or not isinstance(seq, int) or not 0 <= seq <= MAX_SEQUENCE:
            raise RecordError(f"record sequence number must be an integer from 0 to {MAX_SEQUENCE}")
        return cls(key, subkey, value, float(expiration), seq, owner, signature)

    def newer_than(self, other: Record) -> bool:
        """Within one slot: the larger sequence number. Equal ones (only an owner that
        reused a number signs two such records) fall back to expiration, then signature
        bytes, so every peer still picks the same copy."""
        return (self.seq, self.expiration, self.signature) > (
            other.seq,
            other.expiration,
            other.signature,
        )


def record_cost(record: Record) -> int:
    """Bytes a record counts for against the store's total (:class:`GossipStore`): its
    value, key and subkey, and what every record carries besides (owner, signature,
    numbers, the store's own bookkeeping)."""
    subkey = record.subkey
    size = len(subkey) if isinstance(subkey, str | bytes) else 8
    return len(record.value) + len(record.key) + size + RECORD_OVERHEAD


RECORD_OVERHEAD = 256


class GossipStore:
    """Records by slot, with expiry. ``now`` is always passed in; nothing here reads a clock.

    Each owner may hold at most ``max_records_per_owner`` records and
    ``max_bytes_per_owner`` bytes of values, so one peer cannot fill everyone's store; the
    whole store holds at most ``max_records``, except membership records (one per owner),
    so a newcomer can still join a swarm whose store is full.

    The whole store also holds at most ``max_bytes`` (:func:`record_cost`), so identities
    that each stay within their quota cannot fill it together either. When it is full, an
    owner still gets its fair share (``max_bytes`` over the number of owners): its record
    is stored and room is made by dropping records of the owner holding the most; an owner
    past its share is refused (:meth:`over_share`). Honest peers, who store little, keep
    their place however many identities an attacker has; membership records are never
    dropped to make room."""

    def __init__(
        self,
        *,
        max_ttl: float = 7 * 24 * 3600.0,
        max_records: int = 1_000_000,
        max_records_per_owner: int = 1024,
        max_bytes_per_owner: int = 8 << 20,
        max_bytes: int = 32 << 20,
    ) -> None:
        self.max_ttl = max_ttl
        self.max_records = max_records
        self.max_records_per_owner = max_records_per_owner
        self.max_bytes_per_owner = max_bytes_per_owner
        self.max_bytes = max_bytes
        self._records: dict[bytes, Record] = {}
        self._by_key: dict[str, set[bytes]] = {}
        self._usage: dict[bytes, tuple[int, int]] = {}  # owner → (records, value bytes)
        self._cost: dict[bytes, int] = {}  # owner → record_cost of its records
        self._by_owner: dict[bytes, set[bytes]] = {}  # owner → its records' ids
        # record id → when this store took it, oldest first: the news of :meth:`recent_digest`
        self._learnt: dict[bytes, float] = {}
        self.total_bytes = 0  # record_cost of every record held

    def __len__(self) -> int:
        return len(self._records)

    def put(self, record: Record, now: float) -> bool:
        """Insert ``record`` if it is live and newer than what its slot holds.

        Returns False when it was not stored (expired, too far in the future, or not newer
        than the slot's live record: a smaller sequence number). Signatures and owners'
        certificates are the caller's business: :meth:`Record.verify` and
        :class:`~peer.node.certificates.CertificateBook` for remote records.
        """
        if record.expiration <= now or record.expiration > now + self.max_ttl:
            return False
        if not record.may_use_subkey():
            return False  # see Record.check_subkey
        rid = record.rid
        existing = self._records.get(rid)
        if existing is not None and existing.expiration > now and not record.newer_than(existing):
            return False
        if self.over_quota(record):
            self.expire(now)
            if self.over_quota(record):
                return False
            existing = self._records.get(rid)
        if existing is None and len(self._records) >= self.max_records:
            self.expire(now)
            if len(self._records) >= self.max_records and record.key != MEMBERS_KEY:
                return False
        if record.key != MEMBERS_KEY and self._over_total(record, existing):
            self.expire(now)
            existing = self._records.get(rid)
            if self._over_total(record, existing) and not self._make_room(record, existing):
                return False
        self._account(existing, -1)
        self._account(record, +1)
        self._records[rid] = record
        self._by_key.setdefault(record.key, set()).add(rid)
        self._by_owner.setdefault(record.owner, set()).add(rid)
        self._learnt.pop(rid, None)  # to the end: newest last
        self._learnt[rid] = now
        return True

    def _over_total(self, record: Record, existing: Record | None) -> bool:
        held = record_cost(existing) if existing is not None else 0
        return self.total_bytes - held + record_cost(record) > self.max_bytes

    def share(self, owner: bytes) -> int:
        """The bytes ``owner`` may hold once the store is full: an equal part of
        ``max_bytes`` among the owners held (``owner`` counted)."""
        owners = len(self._cost) + (owner not in self._cost)
        return self.max_bytes // owners

    def over_share(self, record: Record) -> bool:
        """Whether the store is full and ``record`` would take its owner past its share:
        such a record is refused (membership records never are)."""
        existing = self._records.get(record.rid)
        if record.key == MEMBERS_KEY or not self._over_total(record, existing):
            return False
        held = record_cost(existing) if existing is not None else 0
        after = self._cost.get(record.owner, 0) - held + record_cost(record)
        return after > self.share(record.owner)

    def _make_room(self, record: Record, existing: Record | None) -> bool:
        """Drop records of the owners holding the most until ``record`` fits; False (and
        nothing dropped) when its owner is past its share."""
        if self.over_share(record):
            return False
        need = record_cost(record) - (record_cost(existing) if existing is not None else 0)
        while self.total_bytes + need > self.max_bytes:
            candidates = [o for o in self._cost if o != record.owner]
            if not candidates:
                return False
            largest = max(candidates, key=lambda o: self._cost[o])
            victim = next(
                (
                    self._records[r]
                    for r in self._by_owner.get(largest, ())
                    if self._records[r].key != MEMBERS_KEY
                ),
                None,
            )
            if victim is None:
                return False
            self._drop([victim])
        return True

    def over_quota(self, record: Record) -> bool:
        """Whether storing ``record`` would take its owner past its quota."""
        count, size = self._usage.get(record.owner, (0, 0))
        existing = self._records.get(record.rid)
        if existing is None:
            count += 1
        else:
            size -= len(existing.value)
        return count > self.max_records_per_owner or size + len(record.value) > (
            self.max_bytes_per_owner
        )

    def _account(self, record: Record | None, sign: int) -> None:
        if record is None:
            return
        count, size = self._usage.get(record.owner, (0, 0))
        count, size = count + sign, size + sign * len(record.value)
        cost = sign * record_cost(record)
        self.total_bytes += cost
        if count:
            self._usage[record.owner] = (count, size)
            self._cost[record.owner] = self._cost.get(record.owner, 0) + cost
        else:
            self._usage.pop(record.owner, None)
            self._cost.pop(record.owner, None)

    def get(self, key: str, now: float) -> ValueWithExpiration[UserMetadata] | None:
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
        by_subkey: dict[Subkey, Record] = {}
        for record in with_subkeys:  # one record per slot: these are different owners
            current = by_subkey.get(record.subkey)
            if current is None or (record.expiration, record.signature) > (
                current.expiration,
                current.signature,
            ):
                by_subkey[record.subkey] = record
        value = {
            sk: ValueWithExpiration(unpack_value(r.value), r.expiration)
            for sk, r in by_subkey.items()
        }
        return ValueWithExpiration(value, max(r.expiration for r in by_subkey.values()))

    def current(self, record: Record, now: float) -> Record | None:
        """The live record held in ``record``'s slot, if any."""
        held = self._records.get(record.rid)
        return held if held is not None and held.expiration > now else None

    def records(self, key: str, now: float) -> list[Record]:
        """Every live record under ``key`` (all owners, all subkeys)."""
        return [
            r
            for r in (self._records[rid] for rid in self._by_key.get(key, ()))
            if r.expiration > now
        ]

    def expire(self, now: float) -> list[Record]:
        """Drop and return every record that has expired by ``now``."""
        return self._drop([r for r in self._records.values() if r.expiration <= now])

    def drop_owners(self, owners: Iterable[bytes]) -> list[Record]:
        """Drop and return every record of these owners (whose certificates expired)."""
        gone = set(owners) & self._usage.keys()
        if not gone:
            return []
        return self._drop([r for r in self._records.values() if r.owner in gone])

    def _drop(self, gone: list[Record]) -> list[Record]:
        for record in gone:
            rid = record.rid
            del self._records[rid]
            self._learnt.pop(rid, None)
            self._account(record, -1)
            _unindex(self._by_key, record.key, rid)
            _unindex(self._by_owner, record.owner, rid)
        return gone

    # anti-entropy ------------------------------------------------------------------------

    def digest(self, now: float) -> bytes:
        """Every live record as (id, sequence number), packed: 20 bytes a record, so a
        digest of thousands of records costs one buffer instead of thousands of msgpack
        objects."""
        pack = _DIGEST_ENTRY.pack
        return b"".join(pack(rid, r.seq) for rid, r in self._records.items() if r.expiration > now)

    def recent_digest(
        self,
        since: float,
        now: float,
        exclude: dict[bytes, int] | None = None,
        limit: int = MAX_DIGEST_ENTRIES,
    ) -> bytes:
        """Like :meth:`digest`, for the live records this store took at ``since`` or later
        only (the news a rumour exchange offers; see :mod:`peer.node.cost`), less the ids in
        ``exclude``, newest first, at most ``limit`` of them. Costs what it lists, not the
        whole store (the times given to :meth:`put` are taken to grow)."""
        pack = _DIGEST_ENTRY.pack
        out: list[bytes] = []
        for rid in reversed(self._learnt):
            if self._learnt[rid] < since or len(out) >= limit:
                break
            record = self._records[rid]
            if record.expiration > now and (exclude is None or rid not in exclude):
                out.append(pack(rid, record.seq))
        return b"".join(out)

    def wanted(self, remote: dict[bytes, int], now: float) -> tuple[list[bytes], list[Record]]:
        """Given a partial digest's entries (:func:`digest_entries` of a
        :meth:`recent_digest`): the ids it lists that are missing or older here, and the
        live records held here in a newer copy than it lists."""
        theirs_newer: list[bytes] = []
        mine_newer: list[Record] = []
        for rid, seq in remote.items():
            mine = self._records.get(rid)
            if mine is None or mine.expiration <= now or mine.seq < seq:
                theirs_newer.append(rid)
            elif mine.seq > seq:
                mine_newer.append(mine)
        return theirs_newer, mine_newer

    def holds(self, record: Record, now: float) -> bool:
        """Whether this store holds ``record`` itself (every field equal), live: such a
        copy is not news and need not be checked again."""
        held = self._records.get(record.rid)
        return held is not None and held.expiration > now and held == record

    def compare(
        self, remote_digest: bytes | bytearray | memoryview, now: float
    ) -> tuple[list[Record], list[bytes]]:
        """Given the other side's digest: the records it lacks or holds older copies of, and
        the ids of records it holds that are missing or older here.

        Only the first :data:`MAX_DIGEST_ENTRIES` entries are read (a full store at the
        default caps lists fewer): a peer cannot make this side build a table of millions
        of ids from one request. Raises RecordError if the digest is not a whole number of
        entries."""
        # a digest lists live records only; a sequence number says which copy is newer
        remote = digest_entries(remote_digest)
        theirs_newer: list[bytes] = []
        for rid, seq in remote.items():
            mine = self._records.get(rid)
            if mine is None or mine.expiration <= now or mine.seq < seq:
                theirs_newer.append(rid)
        mine_newer = [
            r
            for rid, r in self._records.items()
            if r.expiration > now and (rid not in remote or remote[rid] < r.seq)
        ]
        return mine_newer, theirs_newer

    def get_by_ids(self, rids: Iterable[bytes], now: float) -> list[Record]:
        out = []
        for rid in rids:
            record = self._records.get(bytes(rid))
            if record is not None and record.expiration > now:
                out.append(record)
        return out


def digest_entries(digest: bytes | bytearray | memoryview) -> dict[bytes, int]:
    """A packed digest's first :data:`MAX_DIGEST_ENTRIES` entries, id → sequence number
    (a peer cannot make this side build a table of millions of ids from one request).
    RecordError if the digest is not a whole number of entries."""
    if len(digest) % _DIGEST_ENTRY.size:
        raise RecordError(f"a digest is a multiple of {_DIGEST_ENTRY.size} bytes")
    digest = memoryview(digest)[: MAX_DIGEST_ENTRIES * _DIGEST_ENTRY.size]
    return dict(_DIGEST_ENTRY.iter_unpack(digest))


K = TypeVar("K")


def _unindex(index: dict[K, set[bytes]], group: K, rid: bytes) -> None:
    rids = index.get(group)
    if rids is not None:
        rids.discard(rid)
        if not rids:
            del index[group]
