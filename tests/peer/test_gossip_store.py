"""The gossip store without I/O: slots, expiry, newest-wins, signatures, digests,
owners' certificates."""

from __future__ import annotations

import dataclasses
import itertools
import random
from typing import Any

import pytest

from peer.formats.identity import Certificate, CertificateVerifier, Identity
from peer.node.certificates import CertificateBook, certificates_for, sendable, take_within_budget
from peer.node.gossip import (
    MEMBERS_KEY,
    GossipStore,
    Record,
    RecordError,
    Subkey,
    digest_entries,
    next_sequence,
    pack_value,
)

_SEQ = itertools.count(1)


def create(
    identity: Identity,
    key: str,
    subkey: Subkey,
    value: Any,
    expiration: float,
    seq: int | None = None,
) -> Record:
    """``Record.create`` with the next sequence number: records signed in order, as a
    node signs them."""
    return Record.create(
        identity, key, subkey, value, expiration, seq=next(_SEQ) if seq is None else seq
    )


@pytest.fixture
def alice() -> Identity:
    return Identity()


def test_put_get_and_the_newest_sequence_number_wins(alice: Identity) -> None:
    store = GossipStore()
    first = create(alice, "k", None, {"v": 1}, 100.0)
    assert store.put(first, now=0.0)
    assert store.get("k", now=0.0) == ({"v": 1}, 100.0)
    second = create(alice, "k", None, {"v": 2}, 90.0)
    assert store.put(second, now=0.0), "a later write replaces, even with a shorter life"
    assert store.get("k", now=0.0) == ({"v": 2}, 90.0)
    assert not store.put(first, now=0.0), "an older copy never comes back"
    assert store.get("k", now=0.0) == ({"v": 2}, 90.0)


def test_a_relay_cannot_roll_a_slot_back_with_an_older_live_copy(alice: Identity) -> None:
    """The owner restarted (its counter comes from the clock) and stored a value that
    expires sooner than the one before; a relay keeps offering the old, longer-lived copy,
    by push and by anti-entropy. Neither path brings it back."""
    old = create(alice, "state", None, "old", 1000.0, seq=next_sequence(0, 10.0))
    new = create(alice, "state", None, "new", 100.0, seq=next_sequence(0, 20.0))
    honest, relay = GossipStore(), GossipStore()
    relay.put(old, now=30.0)
    assert honest.put(new, now=30.0)
    assert not honest.put(old, now=30.0)
    assert honest.compare(relay.digest(30.0), 30.0) == ([new], []), "nothing asked of the relay"
    assert honest.get("state", now=30.0) == ("new", 100.0)


def test_sequence_numbers_grow_across_restarts_and_within_a_tick() -> None:
    assert next_sequence(0, 100.0) == 100_000_000
    assert next_sequence(100_000_000, 100.0) == 100_000_001, "same instant: still larger"
    assert next_sequence(5, 100.5) == 100_500_000, "a restarted counter starts at the clock"
    with pytest.raises(ValueError, match="seq must be"):
        create(Identity(), "k", None, 1, 10.0, seq=-1)


def test_expired_records_vanish_and_are_refused(alice: Identity) -> None:
    store = GossipStore(max_ttl=1000)
    store.put(create(alice, "k", None, 1, 10.0), now=0.0)
    assert store.get("k", now=10.0) is None
    assert [r.key for r in store.expire(now=10.0)] == ["k"]
    assert len(store) == 0
    assert not store.put(create(alice, "k", None, 1, 5.0), now=6.0)
    assert not store.put(create(alice, "k", None, 1, 5000.0), now=0.0), "beyond max_ttl"


def test_subkeys_form_a_dictionary_and_owners_have_their_own_slots(alice: Identity) -> None:
    bob = Identity()
    store = GossipStore()
    store.put(create(alice, "progress", alice.peer_id, {"step": 1}, 50.0), now=0.0)
    store.put(create(bob, "progress", bob.peer_id, {"step": 2}, 60.0), now=0.0)
    value, expiration = store.get("progress", now=0.0)
    assert expiration == 60.0
    assert value[alice.peer_id].value == {"step": 1}
    assert value[bob.peer_id] == ({"step": 2}, 60.0)
    # Bob writing the same (key, subkey) under a shared name does not touch Alice's record;
    # a read sees the newest.
    store.put(create(alice, "scores", "best", 1, 50.0), now=0.0)
    store.put(create(bob, "scores", "best", 2, 70.0), now=0.0)
    assert store.get("scores", now=0.0).value["best"].value == 2
    assert store.get("scores", now=60.0).value == {"best": (2, 70.0)}
    assert {r.owner for r in store.records("scores", now=0.0)} == {
        alice.public_key,
        bob.public_key,
    }


def test_a_subkey_that_is_a_peer_id_belongs_to_that_peer(alice: Identity) -> None:
    """Nobody can be read as another peer: Bob cannot write under Alice's id, neither
    through his own node nor by relaying a record he signed."""
    bob = Identity()
    store = GossipStore()
    store.put(create(alice, "progress", alice.peer_id, {"step": 1}, 50.0), now=0.0)
    with pytest.raises(RecordError, match="under another peer's id"):
        create(bob, "progress", alice.peer_id, {"step": 99}, 70.0)
    forged = Record(
        "progress", alice.peer_id, pack_value({"step": 99}), 70.0, 7, bob.public_key, b""
    )
    forged = Record(
        forged.key,
        forged.subkey,
        forged.value,
        70.0,
        7,
        bob.public_key,
        bob.sign(forged.signed_bytes()),
    )
    with pytest.raises(RecordError, match=f"peer {bob.peer_id} wrote 'progress' under another"):
        forged.verify()
    assert not store.put(forged, now=0.0)
    assert store.get("progress", now=0.0).value[alice.peer_id].value == {"step": 1}


def test_signature_covers_every_field(alice: Identity) -> None:
    record = create(alice, "k", "s", [1, 2], 100.0)
    record.verify()
    for forged in (
        dataclasses.replace(record, value=create(alice, "k", "s", [9], 100.0).value),
        dataclasses.replace(record, expiration=200.0),
        dataclasses.replace(record, seq=record.seq + 1),
        dataclasses.replace(record, key="other"),
        dataclasses.replace(record, owner=Identity().public_key),
    ):
        with pytest.raises(RecordError, match="invalid signature"):
            forged.verify()


def test_membership_record_must_describe_its_owner(alice: Identity) -> None:
    mallory = Identity()
    member = {"addresses": [], "client_mode": False}
    with pytest.raises(RecordError, match="under another peer's id"):
        create(mallory, MEMBERS_KEY, alice.peer_id, member, 10.0)
    with pytest.raises(RecordError, match="only describe its owner"):
        create(mallory, MEMBERS_KEY, "someone", member, 10.0).verify()


@pytest.mark.parametrize(
    "item",
    [
        None,
        [],
        ["k", None, b"", 1.0, 1, b"", b""][:6],
        ["k", None, b"", 1.0, b"", b""],
        ["", None, b"", 1.0, 1, b"", b""],
        ["k", True, b"", 1.0, 1, b"", b""],
        ["k", None, "str", 1.0, 1, b"", b""],
        ["k", None, b"", "1", 1, b"", b""],
        ["k", None, b"", float("nan"), 1, b"", b""],
        ["k", None, b"", 1.0, -1, b"", b""],
        ["k", None, b"", 1.0, 1 << 63, b"", b""],
        ["k", None, b"", 1.0, True, b"", b""],
        ["k", None, b"", 1.0, 1.5, b"", b""],
    ],
)
def test_from_wire_rejects_malformed_records(item: object) -> None:
    with pytest.raises(RecordError):
        Record.from_wire(item)


def test_anti_entropy_converges_two_stores() -> None:
    a, b = GossipStore(), GossipStore()
    ids = [Identity() for _ in range(3)]
    a.put(create(ids[0], "x", None, 1, 100.0), 0.0)
    a.put(create(ids[1], "y", None, 1, 100.0), 0.0)
    b.put(create(ids[1], "y", None, 2, 150.0), 0.0)  # newer copy of the same slot
    b.put(create(ids[2], "z", None, 3, 100.0), 0.0)
    # a initiates: sends its digest; b answers with what a lacks and asks for what b lacks.
    send_to_a, b_wants = b.compare(a.digest(0.0), 0.0)
    for record in send_to_a:
        a.put(record, 0.0)
    for record in a.get_by_ids(b_wants, 0.0):
        b.put(record, 0.0)
    assert a.digest(0.0) and sorted(a.digest(0.0)) == sorted(b.digest(0.0))
    assert a.get("y", 0.0) == (2, 150.0) and b.get("x", 0.0) == (1, 100.0)
    assert b.compare(a.digest(0.0), 0.0) == ([], [])


def test_a_rumour_exchange_lists_only_recent_records_and_asks_only_for_news() -> None:
    a, b = GossipStore(), GossipStore()
    ids = [Identity() for _ in range(4)]
    old = create(ids[0], "old", None, 1, 100.0)
    for store in (a, b):
        store.put(old, 1.0)  # both took it long ago
    fresh = create(ids[1], "fresh", None, 1, 100.0)
    a.put(fresh, 10.0)
    b_copy_then_newer = create(ids[2], "y", None, 1, 100.0)
    a.put(b_copy_then_newer, 10.0)
    newer = create(ids[2], "y", None, 2, 100.0)
    b.put(newer, 11.0)
    gone = create(ids[3], "gone", None, 1, 12.0)
    a.put(gone, 11.0)
    # a's news since 5.0: fresh and its copy of y (gone expires before "now"), not old
    listed = digest_entries(a.recent_digest(5.0, 12.0))
    assert set(listed) == {fresh.rid, b_copy_then_newer.rid}
    theirs_newer, mine_newer = b.wanted(listed, 12.0)
    assert theirs_newer == [fresh.rid] and mine_newer == [newer]
    # b offers its own news that a did not list: only y's newer copy... which a listed
    assert b.recent_digest(5.0, 12.0, exclude=listed) == b""
    assert digest_entries(b.recent_digest(5.0, 12.0)) == {newer.rid: newer.seq}
    # a record taken again moves to the end: it is news again
    b.put(create(ids[0], "old", None, 2, 100.0), 12.0)
    assert len(digest_entries(b.recent_digest(12.0, 12.0))) == 1
    # the very copy held is recognised; a changed one (forged) is not
    assert a.holds(fresh, 12.0) and not a.holds(dataclasses.replace(fresh, value=b"\x02"), 12.0)
    assert not a.holds(gone, 12.0)


def test_digest_must_be_whole_entries() -> None:
    with pytest.raises(RecordError, match="multiple of 20"):
        GossipStore().compare(b"\x00" * 21, 0.0)


def test_budget_puts_membership_first_and_bounds_size() -> None:
    ident = Identity()
    records = [create(ident, f"k{i}", None, b"x" * 1000, 100.0) for i in range(50)]
    records.append(
        create(ident, MEMBERS_KEY, ident.peer_id, {"addresses": [], "client_mode": False}, 100.0)
    )
    batch = take_within_budget(list(records), 10_000, random.Random(0))
    assert batch[0].key == MEMBERS_KEY
    assert 5 <= len(batch) <= 10


def test_each_owner_has_a_quota_of_records_and_bytes(alice: Identity) -> None:
    mallory = Identity()
    store = GossipStore(max_records_per_owner=10, max_bytes_per_owner=1000)
    stored = [store.put(create(mallory, f"k{i}", None, i, 50.0), now=0.0) for i in range(20)]
    assert stored == [True] * 10 + [False] * 10
    assert store.over_quota(create(mallory, "k99", None, 1, 50.0))
    # a newer record in a slot it already holds is still taken: it replaces, not adds
    assert store.put(create(mallory, "k0", None, "again", 60.0), now=0.0)
    assert store.put(create(alice, "k0", None, "mine", 50.0), now=0.0), "others unaffected"
    big = create(alice, "big", None, b"x" * 2000, 50.0)
    assert store.over_quota(big) and not store.put(big, now=0.0)
    # once its records expire, the owner's quota is free again
    assert store.put(create(mallory, "later", None, 1, 100.0), now=70.0)


def test_membership_is_taken_even_when_the_store_is_full(alice: Identity) -> None:
    store = GossipStore(max_records=3)
    for i in range(3):
        assert store.put(create(alice, f"k{i}", None, i, 50.0), now=0.0)
    newcomer = Identity()
    assert not store.put(create(newcomer, "k", None, 1, 50.0), now=0.0)
    member = {"addresses": ["ws://a:1"], "client_mode": False}
    assert store.put(create(newcomer, MEMBERS_KEY, newcomer.peer_id, member, 50.0), now=0.0)


# --------------------------------------------------------------- owners' certificates


class _Clock:
    def __init__(self, now: float) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def _book(clock: _Clock) -> tuple[Identity, CertificateBook]:
    authority = Identity()
    verifier = CertificateVerifier(authority.public_key, "run", max_clock_skew=5.0, clock=clock)
    return authority, CertificateBook(verifier, max_clock_skew=5.0, send_margin=1.0)


def _certificate(
    authority: Identity, owner: Identity, expires_at: float, run: str = "run"
) -> bytes:
    return Certificate.issue(
        authority, run_id=run, public_key=owner.public_key, expires_at=expires_at
    ).to_bytes()


def test_a_certificate_book_vouches_only_for_owners_the_run_certified(alice: Identity) -> None:
    clock = _Clock(1000.0)
    authority, book = _book(clock)
    mallory, stranger = Identity(), Identity()
    assert not book.valid(alice.public_key, clock.now), "unknown owners own nothing"
    book.offer(alice.public_key, _certificate(authority, alice, 1100.0), clock.now)
    assert book.valid(alice.public_key, clock.now)
    # a certificate Mallory made herself, one for another run, one issued to someone else
    for owner, certificate in (
        (stranger, _certificate(mallory, stranger, 1100.0)),
        (stranger, _certificate(authority, stranger, 1100.0, run="other")),
        (stranger, _certificate(authority, alice, 1100.0)),
    ):
        with pytest.raises(RecordError, match=f"certificate sent for peer {owner.peer_id}"):
            book.offer(owner.public_key, certificate, clock.now)
    assert not book.valid(stranger.public_key, clock.now) and len(book) == 1


def test_a_certificate_book_follows_expiry_and_renewal(alice: Identity) -> None:
    clock = _Clock(1000.0)
    authority, book = _book(clock)
    short = _certificate(authority, alice, 1010.0)
    book.offer(alice.public_key, short, clock.now)
    assert book.certificate_for(alice.public_key, 1008.0) == short
    assert book.certificate_for(alice.public_key, 1009.5) is None, "too close to expiry to send"
    assert book.valid(alice.public_key, 1014.0), "the verifier's clock-skew grace"
    assert book.expire(1014.0) == []
    assert not book.valid(alice.public_key, 1016.0)
    assert book.expire(1016.0) == [alice.public_key] and alice.public_key not in book
    # a renewal replaces the certificate; an older one offered later does not undo it
    renewed = _certificate(authority, alice, 2000.0)
    book.offer(alice.public_key, renewed, clock.now)
    book.offer(alice.public_key, short, clock.now)
    assert book.certificate_for(alice.public_key, 1500.0) == renewed


def test_records_travel_with_their_owners_certificates(alice: Identity) -> None:
    """What a node sends: only records whose owner's certificate it holds (and can still
    send), with each such certificate once; a receiver that never met the owner can then
    vouch for it."""
    clock = _Clock(1000.0)
    authority, book = _book(clock)
    bob, stranger = Identity(), Identity()
    for owner in (alice, bob):
        book.offer(owner.public_key, _certificate(authority, owner, 1100.0), clock.now)
    records = [
        create(alice, "a", None, 1, 1050.0),
        create(alice, "b", None, 2, 1050.0),
        create(bob, "c", None, 3, 1050.0),
        create(stranger, "d", None, 4, 1050.0),
    ]
    assert [r.key for r in sendable(records, book, clock.now)] == ["a", "b", "c"]
    assert sendable(records, None, clock.now) == records, "open mode: everything"
    batch = take_within_budget(list(records), 1 << 20, random.Random(0), book, clock.now)
    assert sorted(r.key for r in batch) == ["a", "b", "c"]
    certs = certificates_for(batch, book, clock.now)
    assert sorted(owner for owner, _ in certs) == sorted([alice.public_key, bob.public_key])
    receiver = CertificateBook(book.verify)  # same run, never met alice or bob
    for owner, certificate in certs:
        receiver.offer(owner, certificate, clock.now)
    assert all(receiver.valid(r.owner, clock.now) for r in batch)
    assert not receiver.valid(stranger.public_key, clock.now)


def test_records_of_owners_whose_certificates_expired_can_be_dropped(alice: Identity) -> None:
    bob = Identity()
    store = GossipStore()
    for i in range(3):
        store.put(create(alice, f"k{i}", None, i, 50.0), now=0.0)
    store.put(create(bob, "k0", None, "bob", 50.0), now=0.0)
    assert {r.key for r in store.drop_owners([alice.public_key])} == {"k0", "k1", "k2"}
    assert store.get("k0", now=0.0) == ("bob", 50.0) and len(store) == 1
    assert store.put(create(alice, "k9", None, 1, 50.0), now=0.0), "its quota is free again"


def test_the_signature_cache_keeps_successes_only_and_stays_bounded() -> None:
    """Forged messages, however large, leave nothing behind; verified ones are remembered
    by a digest, at most max_entries of them."""
    from peer.formats.identity import _VerifiedSignatures

    cache = _VerifiedSignatures(max_entries=4)
    ident = Identity()
    huge = b"x" * (1 << 20)
    assert not cache.check(ident.public_key, bytes(64), huge)
    assert len(cache) == 0
    signed = [(m, ident.sign(m)) for m in (b"m%d" % i for i in range(6))]
    assert all(cache.check(ident.public_key, sig, m) for m, sig in signed)
    assert len(cache) == 4
    assert not cache.check(ident.public_key, signed[0][1], signed[1][0]), "wrong message"
    assert cache.check(ident.public_key, signed[0][1], signed[0][0]), "evicted: checked again"
    assert all(len(k) == 32 for k in cache._seen), "keyed by a digest, not by the message"


def test_a_full_store_keeps_each_owner_its_fair_share() -> None:
    """Past ``max_bytes`` the owners holding the most make room: a newcomer within its
    share is stored, an owner past its share is refused, and membership records are
    neither refused nor dropped."""
    from peer.node.gossip import record_cost

    store = GossipStore(max_bytes=64 << 10)
    sybils = [Identity() for _ in range(4)]
    for sybil in sybils:  # each within its quota; together they fill the store
        for i in range(16):
            store.put(create(sybil, "junk", i, bytes(2000), 100.0), 0.0)
    assert store.total_bytes <= store.max_bytes
    assert store.total_bytes > store.max_bytes - 4096  # full
    honest = Identity()
    record = create(honest, "progress", honest.peer_id, [1, 2], 100.0)
    assert not store.over_share(record)
    assert store.put(record, 0.0)
    assert store.total_bytes <= store.max_bytes
    assert store.get("progress", 0.0) is not None
    # a sybil already at its share is refused (nothing of anyone's is dropped for it)
    held = store.total_bytes
    late = create(sybils[0], "junk", 99, bytes(2000), 100.0)
    assert store.over_share(late)
    assert not store.put(late, 0.0)
    assert store.total_bytes == held
    member = create(
        honest, MEMBERS_KEY, honest.peer_id, {"addresses": [], "client_mode": False}, 100.0
    )
    assert store.put(member, 0.0)
    assert store.total_bytes == held + record_cost(member)
    store.expire(200.0)
    assert store.total_bytes == 0 and len(store) == 0


def test_a_digest_is_read_up_to_its_bound() -> None:
    """A digest of millions of entries costs the responder a bounded table: the entries
    past MAX_DIGEST_ENTRIES are not read (nothing of them is wanted)."""
    import peer.node.gossip as gossip

    store = GossipStore()
    entry = bytes(12) + (1).to_bytes(8, "big")
    wanted_ids = [i.to_bytes(12, "big") for i in range(gossip.MAX_DIGEST_ENTRIES + 10)]
    digest = b"".join(rid + (1).to_bytes(8, "big") for rid in wanted_ids)
    _, theirs_newer = store.compare(digest, 0.0)
    assert len(theirs_newer) == gossip.MAX_DIGEST_ENTRIES
    assert theirs_newer[-1] == wanted_ids[gossip.MAX_DIGEST_ENTRIES - 1]
    with pytest.raises(RecordError):
        store.compare(entry[:-1], 0.0)
