"""Peers that fell out of membership without saying goodbye, dialed again now and then.

Membership is soft state: a peer nobody heard from for ``member_ttl`` is forgotten. A fault
that lasts longer than that (a link down, a laptop asleep, a burst of loss) can split a
swarm in two: each side forgets the other, and with nobody left to gossip to across the
split, it would never heal. So a node remembers the addresses of peers whose membership
expired while they still had some (a clean leave publishes none) and, once per interval,
dials one of them again, until it is back or a long give-up time has passed.

Pure bookkeeping: the node supplies the clock and does the dialing.
"""

from __future__ import annotations

import random
from collections.abc import Container
from dataclasses import dataclass


@dataclass(slots=True)
class _Departed:
    addresses: tuple[str, ...]
    since: float


class Reconnector:
    def __init__(
        self,
        *,
        interval: float,
        give_up_after: float,
        capacity: int = 256,
        rng: random.Random | None = None,
    ) -> None:
        if interval <= 0 or give_up_after <= 0 or capacity < 1:
            raise ValueError("need interval > 0, give_up_after > 0 and capacity >= 1")
        self.interval = interval
        self.give_up_after = give_up_after
        self.capacity = capacity
        self.random = rng or random.Random()
        self._departed: dict[str, _Departed] = {}  # insertion order: oldest first
        self._next_try: float | None = None

    def __len__(self) -> int:
        return len(self._departed)

    def __contains__(self, peer_id: object) -> bool:
        return peer_id in self._departed

    def departed(self, peer_id: str, addresses: tuple[str, ...], now: float) -> None:
        """``peer_id``'s membership expired while it listened at ``addresses``."""
        if not addresses:
            return  # a clean leave or a client-mode peer: nothing to dial
        self._departed.pop(peer_id, None)
        self._departed[peer_id] = _Departed(tuple(addresses), now)
        while len(self._departed) > self.capacity:
            del self._departed[next(iter(self._departed))]
        if self._next_try is None:
            self._next_try = now + self.interval

    def returned(self, peer_id: str) -> None:
        self._departed.pop(peer_id, None)

    def due(self, now: float, live: Container[str] = ()) -> tuple[str, str] | None:
        """At most once per interval, one departed peer to dial: ``(peer_id, address)``.
        Peers in ``live`` (back in membership through someone else) and peers gone longer
        than the give-up time are dropped first."""
        for peer_id, entry in list(self._departed.items()):
            if peer_id in live or now - entry.since > self.give_up_after:
                del self._departed[peer_id]
        if not self._departed:
            self._next_try = None
            return None
        if self._next_try is not None and now < self._next_try:
            return None
        self._next_try = now + self.interval
        peer_id = self.random.choice(list(self._departed))
        return peer_id, self.random.choice(self._departed[peer_id].addresses)
