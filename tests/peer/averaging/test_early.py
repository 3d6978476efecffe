"""The room for frames that arrive before their group: bounded in all and per sender."""

from __future__ import annotations

import pytest

from peer.averaging.allreduce.early import FRAME_OVERHEAD, EarlyFrames
from peer.wire import Frame


def _frame(nbytes: int, tag: int = 0) -> Frame:
    return Frame("avg.part", {"i": tag}, bytes(nbytes))


def test_frames_come_back_by_group_in_arrival_order_and_free_their_room() -> None:
    room = EarlyFrames(total_limit=10_000, sender_limit=5_000)
    assert room.add(b"g1", "alice", _frame(100, 1))
    assert room.add(b"g2", "bob", _frame(100, 2))
    assert room.add(b"g1", "bob", _frame(100, 3))
    assert room.nbytes == 3 * (100 + FRAME_OVERHEAD) and len(room) == 3
    taken = room.take(b"g1")
    assert [(s, f.fields["i"]) for s, f in taken] == [("alice", 1), ("bob", 3)]
    assert room.take(b"g1") == []
    assert room.held_by("alice") == 0 and room.held_by("bob") == 100 + FRAME_OVERHEAD
    room.drop()
    assert room.nbytes == 0 and len(room) == 0 and room.held_by("bob") == 0


def test_one_sender_inventing_groups_cannot_crowd_out_the_others() -> None:
    """A hostile sender floods made-up group ids: it fills its own share and no more, and
    an honest member's parts for the real group are still kept."""
    part = 1_000
    room = EarlyFrames(total_limit=4 * part + 4_096, sender_limit=part + 512)
    kept = sum(room.add(bytes([i]) * 16, "mallory", _frame(100)) for i in range(200))
    assert kept == (part + 512) // (100 + FRAME_OVERHEAD)
    assert room.held_by("mallory") <= room.sender_limit
    assert room.add(b"real", "alice", _frame(part))
    assert room.add(b"real", "bob", _frame(part))
    room.drop(keep=b"real")  # the group began: every other group's frames go
    assert room.held_by("mallory") == 0
    assert [s for s, _ in room.take(b"real")] == ["alice", "bob"]


def test_the_room_in_all_is_bounded_too() -> None:
    room = EarlyFrames(total_limit=3 * (100 + FRAME_OVERHEAD), sender_limit=10_000)
    assert all(room.add(b"g", f"peer{i}", _frame(100)) for i in range(3))
    assert not room.add(b"g", "peer3", _frame(100))
    assert room.held_by("peer3") == 0
    assert not room.add(b"g", "peer0", _frame(0))  # an empty frame costs its overhead


def test_limits_must_be_positive() -> None:
    with pytest.raises(ValueError):
        EarlyFrames(total_limit=0, sender_limit=1)
