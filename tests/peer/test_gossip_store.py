"""The gossip store without I/O: slots, expiry, newest-wins, signatures, digests."""

from __future__ import annotations

import random

import pytest

from peer.identity import Identity
from peer.node.gossip import MEMBERS_KEY, GossipStore, Record, RecordError, take_within_budget


@pytest.fixture
def alice() -> Identity:
    return Identity()


def test_put_get_and_newest_expiration_wins(alice: Identity) -> None:
    store = GossipStore()
    assert store.put(Record.create(alice, "k", None, {"v": 1}, 100.0), now=0.0)
    assert store.get("k", now=0.0) == ({"v": 1}, 100.0)
    assert not store.put(Record.create(alice, "k", None, {"v": 0}, 90.0), now=0.0), (
        "older must not replace"
    )
    assert store.put(Record.create(alice, "k", None, {"v": 2}, 110.0), now=0.0)
    assert store.get("k", now=0.0) == ({"v": 2}, 110.0)


def test_expired_records_vanish_and_are_refused(alice: Identity) -> None:
    store = GossipStore(max_ttl=1000)
    store.put(Record.create(alice, "k", None, 1, 10.0), now=0.0)
    assert store.get("k", now=10.0) is None
    assert [r.key for r in store.expire(now=10.0)] == ["k"]
    assert len(store) == 0
    assert not store.put(Record.create(alice, "k", None, 1, 5.0), now=6.0)
    assert not store.put(Record.create(alice, "k", None, 1, 5000.0), now=0.0), "beyond max_ttl"


def test_subkeys_form_a_dictionary_and_owners_have_their_own_slots(alice: Identity) -> None:
    bob = Identity()
    store = GossipStore()
    store.put(Record.create(alice, "progress", alice.peer_id, {"step": 1}, 50.0), now=0.0)
    store.put(Record.create(bob, "progress", bob.peer_id, {"step": 2}, 60.0), now=0.0)
    value, expiration = store.get("progress", now=0.0)
    assert expiration == 60.0
    assert value[alice.peer_id].value == {"step": 1}
    assert value[bob.peer_id] == ({"step": 2}, 60.0)
    # Bob writing the same (key, subkey) as Alice does not touch Alice's record; a read sees the newest.
    store.put(Record.create(bob, "progress", alice.peer_id, {"step": 99}, 70.0), now=0.0)
    assert store.get("progress", now=0.0).value[alice.peer_id].value == {"step": 99}
    # At 65 Alice's own record (until 50) and Bob's own (until 60) are gone; Bob's copy remains.
    assert store.get("progress", now=65.0).value == {alice.peer_id: ({"step": 99}, 70.0)}
    assert {r.owner for r in store.records("progress", now=0.0)} == {
        alice.public_key,
        bob.public_key,
    }
    assert len(store.records("progress", now=0.0)) == 3


def test_signature_covers_every_field(alice: Identity) -> None:
    record = Record.create(alice, "k", "s", [1, 2], 100.0)
    record.verify()
    for forged in (
        Record(
            record.key,
            record.subkey,
            Record.create(alice, "k", "s", [9], 100.0).value,
            100.0,
            record.owner,
            record.signature,
        ),
        Record(record.key, record.subkey, record.value, 200.0, record.owner, record.signature),
        Record("other", record.subkey, record.value, 100.0, record.owner, record.signature),
        Record(
            record.key, record.subkey, record.value, 100.0, Identity().public_key, record.signature
        ),
    ):
        with pytest.raises(RecordError, match="invalid signature"):
            forged.verify()


def test_membership_record_must_describe_its_owner(alice: Identity) -> None:
    mallory = Identity()
    with pytest.raises(RecordError, match="only describe its owner"):
        Record.create(
            mallory, MEMBERS_KEY, alice.peer_id, {"addresses": [], "client_mode": False}, 10.0
        ).verify()


@pytest.mark.parametrize(
    "item",
    [
        None,
        [],
        ["k", None, b"", 1.0, b"", b""][:5],
        ["", None, b"", 1.0, b"", b""],
        ["k", True, b"", 1.0, b"", b""],
        ["k", None, "str", 1.0, b"", b""],
        ["k", None, b"", "1", b"", b""],
        ["k", None, b"", float("nan"), b"", b""],
    ],
)
def test_from_wire_rejects_malformed_records(item: object) -> None:
    with pytest.raises(RecordError):
        Record.from_wire(item)


def test_anti_entropy_converges_two_stores() -> None:
    a, b = GossipStore(), GossipStore()
    ids = [Identity() for _ in range(3)]
    a.put(Record.create(ids[0], "x", None, 1, 100.0), 0.0)
    a.put(Record.create(ids[1], "y", None, 1, 100.0), 0.0)
    b.put(Record.create(ids[1], "y", None, 2, 150.0), 0.0)  # newer copy of the same slot
    b.put(Record.create(ids[2], "z", None, 3, 100.0), 0.0)
    # a initiates: sends its digest; b answers with what a lacks and asks for what b lacks.
    send_to_a, b_wants = b.compare(a.digest(0.0), 0.0)
    for record in send_to_a:
        a.put(record, 0.0)
    for record in a.get_by_ids(b_wants, 0.0):
        b.put(record, 0.0)
    assert a.digest(0.0) and sorted(a.digest(0.0)) == sorted(b.digest(0.0))
    assert a.get("y", 0.0) == (2, 150.0) and b.get("x", 0.0) == (1, 100.0)
    assert b.compare(a.digest(0.0), 0.0) == ([], [])


def test_digest_must_be_whole_entries() -> None:
    with pytest.raises(RecordError, match="multiple of 20"):
        GossipStore().compare(b"\x00" * 21, 0.0)


def test_budget_puts_membership_first_and_bounds_size() -> None:
    ident = Identity()
    records = [Record.create(ident, f"k{i}", None, b"x" * 1000, 100.0) for i in range(50)]
    records.append(
        Record.create(
            ident, MEMBERS_KEY, ident.peer_id, {"addresses": [], "client_mode": False}, 100.0
        )
    )
    batch = take_within_budget(list(records), 10_000, random.Random(0))
    assert batch[0].key == MEMBERS_KEY
    assert 5 <= len(batch) <= 10
