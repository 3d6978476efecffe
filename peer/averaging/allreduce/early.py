"""Frames that arrive before their group: a bounded waiting room, without I/O.

A member that learns of its group first may send its parts at once, before the group's
notice reaches this peer; the averager keeps such frames until the group begins here (or
drops them when it does not). Anyone can send frames, so the room is bounded twice: in all,
and per sender — one sender (say, one inventing group ids) fills at most its own share and
cannot crowd out the frames of the group's honest members. Each frame counts its payload
plus :data:`FRAME_OVERHEAD` bytes, so a flood of empty frames is bounded too.
"""

from __future__ import annotations

from peer.wire import Frame

__all__ = ["FRAME_OVERHEAD", "EarlyFrames"]

#: what a frame costs beyond its payload (header, bookkeeping)
FRAME_OVERHEAD = 256


def frame_cost(frame: Frame) -> int:
    return memoryview(frame.payload).nbytes + FRAME_OVERHEAD


class EarlyFrames:
    """Frames by group id, in arrival order, within ``total_limit`` bytes in all and
    ``sender_limit`` bytes per sender."""

    def __init__(self, total_limit: int, sender_limit: int) -> None:
        if total_limit <= 0 or sender_limit <= 0:
            raise ValueError("the limits must be positive")
        self.total_limit = total_limit
        self.sender_limit = sender_limit
        self._groups: dict[bytes, list[tuple[str, Frame]]] = {}
        self._by_sender: dict[str, int] = {}
        self.nbytes = 0

    def add(self, group_id: bytes, sender: str, frame: Frame) -> bool:
        """Keep ``frame``; False (nothing kept) if it would take its sender or the room
        past a limit."""
        cost = frame_cost(frame)
        held = self._by_sender.get(sender, 0)
        if held + cost > self.sender_limit or self.nbytes + cost > self.total_limit:
            return False
        self._groups.setdefault(group_id, []).append((sender, frame))
        self._by_sender[sender] = held + cost
        self.nbytes += cost
        return True

    def take(self, group_id: bytes) -> list[tuple[str, Frame]]:
        """The group's frames, in arrival order, removed from the room."""
        frames = self._groups.pop(group_id, [])
        for sender, frame in frames:
            self._release(sender, frame)
        return frames

    def drop(self, keep: bytes | None = None) -> None:
        """Forget every group's frames but ``keep``'s."""
        for group_id in [g for g in self._groups if g != keep]:
            self.take(group_id)

    def held_by(self, sender: str) -> int:
        """Bytes ``sender``'s frames take up."""
        return self._by_sender.get(sender, 0)

    def __len__(self) -> int:
        return sum(len(frames) for frames in self._groups.values())

    def _release(self, sender: str, frame: Frame) -> None:
        cost = frame_cost(frame)
        self.nbytes -= cost
        left = self._by_sender[sender] - cost
        if left > 0:
            self._by_sender[sender] = left
        else:
            del self._by_sender[sender]
