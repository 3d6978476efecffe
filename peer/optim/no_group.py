"""What a volunteer tells itself when it finds no group to average with.

From its own optimizer's counters (rounds done and failed, its epoch) and the gossip
membership (peers online), :class:`NoGroupWatch` says "no group for N rounds while K peers
are online: <reason>; <what helps>" once :data:`NO_GROUP_ROUNDS` rounds went by without a
completed one while others were online, and nothing again after a round completes. The
reason comes from this peer's path (:func:`peer.coordinator.joining.path_of`). No I/O:
the volunteer feeds it at each status update.
"""

from __future__ import annotations

NO_GROUP_ROUNDS = 3  # rounds without a group before the volunteer's line says so

FORWARD = "forward a port or turn on UPnP on your router (docs/volunteers.md)"
_WHY = {
    "unreachable": "this machine has no link to any other peer",
    "dialing out": "no other peer can reach this machine",
    "relayed": "this machine reaches the others only through relays, and no round formed",
    "punched": "its punched links do not carry a round",
    "public": "its links to the other peers fail",
}
_HELPS = {
    "unreachable": f"{FORWARD}, or ask the organizer for a relay",
    "dialing out": f"{FORWARD}, or ask the organizer for a relay",
    "relayed": f"{FORWARD}, or ask the organizer whether the relay is full",
    "punched": f"{FORWARD}, or ask the organizer for a relay",
    "public": "check this machine's firewall, or ask the organizer about the others",
}


class NoGroupWatch:
    """Counts the rounds since this peer last completed one (see the module doc)."""

    def __init__(self) -> None:
        self._done: int | None = None  # rounds done when last seen
        self._failed = 0  # rounds failed at the last completed round (or the start)
        self._epoch = 0  # the epoch then

    def observe(
        self,
        *,
        epoch: int,
        rounds_done: int,
        rounds_failed: int,
        peers_online: int,
        path: str | None,
    ) -> str | None:
        """The line to show now, or None. ``peers_online`` counts this peer (the gossip
        membership's size); ``rounds_done`` and ``rounds_failed`` are the optimizer's totals."""
        if self._done is None or rounds_done != self._done:
            self._done, self._failed, self._epoch = rounds_done, rounds_failed, epoch
            return None
        # Rounds that failed and epochs stepped alone may be the same rounds: the larger.
        rounds = max(rounds_failed - self._failed, epoch - self._epoch)
        others = peers_online - 1
        if rounds < NO_GROUP_ROUNDS or others < 1:
            return None
        key = path if path in _WHY else "unreachable"
        peers = "peer is" if others == 1 else "peers are"
        return (
            f"no group for {rounds} rounds while {others} other {peers} online: "
            f"{_WHY[key]}; {_HELPS[key]}"
        )
