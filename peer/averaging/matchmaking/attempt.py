"""One matchmaking attempt's bookkeeping, without I/O.

An :class:`Attempt` is what a :class:`~peer.averaging.matchmaking.machine.Matchmaker` holds from
:meth:`~peer.averaging.matchmaking.machine.Matchmaker.start` to its group or failure: its own
declaration, the leader it waits on, the leaders it gave up on, its followers, and the
redirect bookkeeping of rule 4 in :mod:`peer.averaging.matchmaking.machine` — the peers announced to
it as a leader (it holds the group open for them) and the peers it sent ahead to the leader
it asks. The rules that drive it, and why they cannot deadlock, are in that module.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from peer.averaging.matchmaking.messages import (
    Command,
    Declaration,
    GroupInfo,
    MatchmakingConfig,
    Notify,
    PeerID,
    Redirected,
)

#: how many announced peers a leader holds for when the group size is unbounded
MAX_EXPECTED = 64


@dataclass
class Follower:
    declaration: Declaration
    metadata: bytes


@dataclass
class Attempt:
    """Per-attempt state (a new one on every :meth:`Matchmaker.start`)."""

    declaration: Declaration
    metadata: bytes
    deadline: float
    config: MatchmakingConfig
    leader: Declaration | None = None  # the peer waited on (REQUESTING / FOLLOWING)
    since: float = 0.0  # when the request was sent / acceptance arrived
    # declaration (by identity) → the revision of it this peer gave up on
    tried: dict[tuple[float, PeerID], int] = field(default_factory=dict)
    followers: dict[PeerID, Follower] = field(default_factory=dict)
    # peers a follower said it sent here, not yet arrived (the leader holds for them)
    expected: set[PeerID] = field(default_factory=set)
    # peers this one sent ahead to the leader it asks (named in its requests)
    sent_ahead: set[PeerID] = field(default_factory=set)

    @property
    def peer_id(self) -> PeerID:
        return self.declaration.peer_id

    @property
    def limit(self) -> int:
        """How many announced peers a leader holds for, and a request names."""
        return self.config.target_group_size or MAX_EXPECTED

    # ------------------------------------------------------------ leading

    def is_full(self) -> bool:
        target = self.config.target_group_size
        return target is not None and 1 + len(self.followers) >= target

    def hold_end(self) -> float:
        return min(self.declaration.start_time + self.config.grace, self.deadline)

    def holding(self, now: float) -> bool:
        """Past its start time, does this leader still hold the group open for announced
        peers (rule 4)?"""
        return bool(self.expected) and now < self.hold_end()

    def expect(self, peer_ids: tuple[PeerID, ...]) -> None:
        """A leader learns of peers sent to it (rule 4): a claim, so at most a group's worth."""
        limit = self.limit
        for peer_id in peer_ids[:limit]:
            if len(self.expected) >= limit:
                break
            if peer_id != self.peer_id and peer_id not in self.followers:
                self.expected.add(peer_id)

    # ---------------------------------------------------------- following

    def viable(self, other: Declaration) -> bool:
        """May this peer ask ``other`` to lead it? (rule 1 and compatibility)"""
        me = self.declaration
        if other.peer_id == self.peer_id or other.client_mode or not me.compatible(other):
            return False
        if not me.client_mode and not other.precedes(me, self.config.order):
            return False
        if other.start_time > self.deadline:
            return False  # it would assemble after this peer gave up
        # a newer revision means the peer leads again after a failed attempt to follow
        return self.tried.get(other.identity, -1) < other.revision

    def give_up_on(self, leader: Declaration) -> None:
        # the revision we asked, not the newest known: if the peer has led again since
        # (a newer revision reached us meanwhile), it is worth asking again
        self.tried[leader.identity] = max(self.tried.get(leader.identity, -1), leader.revision)

    def follow_deadline(self) -> float:
        # a live leader assembles or disbands us by its own deadline; only a dead or
        # stalled one makes us wait that long (the I/O layer reports lost connections
        # sooner through on_peer_lost)
        assert self.leader is not None
        return max(self.leader.deadline, self.since) + self.config.grace

    def pass_on(self, peer_ids: tuple[PeerID, ...]) -> list[Command]:
        """A peer that waits tells the leader it waits on of the peers it points there
        (rule 2), once each; its later requests name them too (``sent_ahead``)."""
        assert self.leader is not None
        leader = self.leader.peer_id
        new = tuple(
            p
            for p in dict.fromkeys(peer_ids[: self.limit])
            if p not in (self.peer_id, leader) and p not in self.sent_ahead
        )
        if not new:
            return []
        self.sent_ahead.update(new)
        return [Notify(leader, Redirected(self.peer_id, new))]

    def bringing(self, leader: Declaration) -> tuple[PeerID, ...]:
        """The peers a request to ``leader`` names as sent ahead to it (rule 4)."""
        return tuple(sorted(self.sent_ahead - {leader.peer_id}))[: self.limit]


def acceptable(
    config: MatchmakingConfig, now: float, group: GroupInfo, leader: Declaration
) -> bool:
    """Does a follower with ``config`` take part in ``group``, assembled by ``leader``? Its
    size must be within the follower's own bounds, not the leader's: a leader may not cut the
    group (for instance to pair itself with one peer) below ``min_group_size``, nor, before
    its declared start time (less ``grace``, for clock skew), below ``target_group_size``
    (rule 4: a leader assembles early only when full). Refused, the leader's all-reduce
    excludes this peer as one that never began (see :mod:`peer.averaging.matchmaking.machine`)."""
    size = group.size
    if (
        len(set(group.peer_ids)) != size
        or len(group.gathered) != size
        or len(group.client_mode) != size
    ):
        return False
    target = config.target_group_size
    if size < config.min_group_size or (target is not None and size > target):
        return False
    early = now < leader.start_time - config.grace
    return not (early and (target is None or size < target))
