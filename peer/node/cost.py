"""How a node's gossip scales with the swarm's size N: what keeps the bytes each peer sends
and receives per second growing as log N, not N (the design is in docs/architecture.md,
"Gossip cost").

Three functions of the number of live members a node knows: :func:`membership_ttl` (how
long a membership record lives), :func:`news_rounds` (how long a record stays news in
rumour exchanges) and :func:`full_sync_chance` (how often an exchange compares whole
stores). Each docstring says why its growth keeps the cost logarithmic.
"""

from __future__ import annotations

import math

__all__ = ["FULL_SYNC_UP_TO", "SCALE_FROM", "full_sync_chance", "membership_ttl", "news_rounds"]

SCALE_FROM = 32  # members: above this, membership records live longer (membership_ttl)
FULL_SYNC_UP_TO = 16  # members: up to this, every exchange compares whole stores
_FULL_SYNC_FACTOR = FULL_SYNC_UP_TO / math.log2(FULL_SYNC_UP_TO)


def _check(n: int) -> None:
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise ValueError(f"a swarm size is a non-negative integer, not {n!r}")


def membership_ttl(member_ttl: float, n: int, cap: float) -> float:
    """The time to live of a node's membership record in a swarm of ``n`` live members:
    ``member_ttl`` up to :data:`SCALE_FROM` members, then growing in proportion to ``n``
    (the swarm then refreshes ``3·SCALE_FROM / member_ttl`` records a second, whatever
    its size: records are refreshed every third of their life), never past ``cap`` (the
    longest time to live peers accept).

    Every peer holds every membership record, so each refresh must reach all N peers: with
    a fixed time to live the cost would be linear in N however they travel. The price: a
    peer that dies without a goodbye stays listed for longer in a large swarm (a clean
    leave is gossiped at once, and a peer that stops answering is skipped by the one that
    noticed)."""
    _check(n)
    return min(member_ttl * max(1.0, n / SCALE_FROM), max(cap, member_ttl))


def news_rounds(n: int) -> int:
    """Gossip rounds a record stays news after it arrived, in a swarm of ``n``: about
    log2 n. Push-pull gossip with a fanout of 3 reaches all n peers in O(log n) rounds, so a
    record offered for that long reaches everyone, and each peer offers each record a
    bounded number of times."""
    _check(n)
    return math.ceil(math.log2(n + 1)) + 2


def full_sync_chance(n: int) -> float:
    """The probability that one exchange compares whole stores, in a swarm of ``n``: 1 up
    to :data:`FULL_SYNC_UP_TO` members, then ``c·log2(n)/n`` (the same at that size).

    A whole-store digest is 20 bytes a record, linear in n, so at this rate these exchanges
    cost O(log n) bytes a round on average; they catch whatever rumours missed (a node that
    was away, a lost frame)."""
    _check(n)
    if n <= FULL_SYNC_UP_TO:
        return 1.0
    return min(1.0, _FULL_SYNC_FACTOR * math.log2(n) / n)
