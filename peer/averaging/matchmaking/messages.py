"""The matchmaking protocol's vocabulary, without I/O: its settings
(:class:`MatchmakingConfig`), the messages peers exchange (declarations in gossip, join
requests and responses, a group's description, notices), the commands the
:class:`~peer.averaging.matchmaking.machine.Matchmaker` returns for its driver to execute, and the
machine's states. The rules that use them are in :mod:`peer.averaging.matchmaking.machine`."""

from __future__ import annotations

import enum
import hashlib
import math
from dataclasses import dataclass
from typing import Literal

PeerID = str

#: the total orders matchmaking can follow (see :attr:`MatchmakingConfig.order`)
Order = Literal["rank", "start_time"]
ORDERS: tuple[Order, ...] = ("rank", "start_time")


# ------------------------------------------------------------------ configuration


@dataclass(frozen=True)
class MatchmakingConfig:
    """Matchmaking options (seed names: hivemind's ``DecentralizedAverager``).

    ``target_group_size=None`` means no upper bound. ``assembly_grace`` (default
    ``request_timeout``) is how long past a leader's start time a follower keeps waiting.

    ``order`` is the total order in which leaders are followed (:meth:`Declaration.order_key`):
    ``"rank"`` (the default) by :attr:`Declaration.rank`, a hash of the group key and the
    peer id that no peer chooses, so no declaration (say, one with no matchmaking wait, or
    made early) puts a peer first; ``"start_time"`` by declared start time, the earliest
    leading: a group assembles at the earliest start, but whoever declares the earliest time
    leads every group it reaches, so only for swarms whose members trust each other.
    """

    target_group_size: int | None = None
    min_group_size: int = 2
    min_matchmaking_time: float = 5.0
    request_timeout: float = 3.0
    assembly_grace: float | None = None
    order: Order = "rank"

    def __post_init__(self) -> None:
        if self.min_group_size < 1:
            raise ValueError("min_group_size must be at least 1")
        if self.target_group_size is not None and self.target_group_size < self.min_group_size:
            raise ValueError("target_group_size must be >= min_group_size")
        if self.min_matchmaking_time < 0 or self.request_timeout <= 0:
            raise ValueError("min_matchmaking_time must be >= 0 and request_timeout > 0")
        if self.assembly_grace is not None and self.assembly_grace < 0:
            raise ValueError("assembly_grace must be >= 0")
        if self.order not in ORDERS:
            raise ValueError(f"order must be one of {', '.join(ORDERS)}, not {self.order!r}")

    @property
    def grace(self) -> float:
        return self.request_timeout if self.assembly_grace is None else self.assembly_grace


# -------------------------------------------------------------- messages (wire)


@dataclass(frozen=True)
class Declaration:
    """A peer's intent to average, spread by gossip under ``group_key``.

    ``revision`` grows each time the peer becomes free to lead again (after a failed attempt
    to join someone), so peers that had given up on it try it again; it is not part of the
    order.
    """

    group_key: str
    peer_id: PeerID
    start_time: float
    schema_hash: bytes
    client_mode: bool = False
    revision: int = 0
    deadline: float = math.inf  # the peer gives up (and disbands its followers) by then

    @property
    def identity(self) -> tuple[float, PeerID]:
        """Which declaration this is: a peer's new attempt declares a new start time."""
        return (self.start_time, self.peer_id)

    @property
    def rank(self) -> bytes:
        """``sha256(group_key ‖ peer_id)``: the same on every peer, chosen by none (a peer
        chooses its id once, before it knows the round's key), new with each group key."""
        return hashlib.sha256(f"{self.group_key}\x00{self.peer_id}".encode()).digest()

    def order_key(self, order: Order = "rank") -> tuple[bytes | float, PeerID]:
        """Position in the one total order that makes matchmaking deadlock-free: by
        :attr:`rank` or by declared start time (see :attr:`MatchmakingConfig.order`), then
        peer id. Only fields carried verbatim: every peer computes the same."""
        return (self.rank if order == "rank" else self.start_time, self.peer_id)

    def precedes(self, other: Declaration, order: Order = "rank") -> bool:
        return self.order_key(order) < other.order_key(order)

    def compatible(self, other: Declaration) -> bool:
        """Same group key and tensor schema: allowed to share a group."""
        return self.group_key == other.group_key and self.schema_hash == other.schema_hash


@dataclass(frozen=True)
class JoinRequest:
    """Follower → leader: "let me join"; ``metadata`` is gathered into :class:`GroupInfo`.

    ``bringing`` names the peers the requester sent ahead of it in this attempt (its former
    followers, redirected): the leader expects them (rule 4). A claim, so the leader bounds
    it: at most a group's worth, and it only ever delays assembly by ``assembly_grace``.
    """

    requester: Declaration
    leader_id: PeerID
    metadata: bytes = b""
    bringing: tuple[PeerID, ...] = ()


class ResponseStatus(enum.Enum):
    ACCEPTED = "accepted"
    REFUSED = "refused"
    REDIRECT = "redirect"


class RefuseReason(enum.Enum):
    NOT_LOOKING = "not_looking"  # idle, failed, or not matchmaking for this step
    BUSY = "busy"  # already in a group
    FULL = "full"
    WRONG_KEY = "wrong_key"
    WRONG_SCHEMA = "wrong_schema"
    WRONG_ORDER = "wrong_order"  # the requester does not come after this leader
    CLIENT_MODE = "client_mode"  # client-mode peers never lead


@dataclass(frozen=True)
class JoinResponse:
    """Leader → follower answer to a :class:`JoinRequest` (sent at once, never deferred)."""

    leader_id: PeerID
    status: ResponseStatus
    reason: RefuseReason | None = None
    redirect_to: Declaration | None = None


@dataclass(frozen=True)
class GroupInfo:
    """An assembled group (hivemind's ``GroupInfo`` plus gathered metadata).

    ``peer_ids`` are ordered leader first, then by declaration order; that order assigns
    reducer spans. ``gathered[i]`` and ``client_mode[i]`` belong to ``peer_ids[i]``.
    """

    group_id: bytes
    group_key: str
    leader: PeerID
    peer_ids: tuple[PeerID, ...]
    gathered: tuple[bytes, ...]
    client_mode: tuple[bool, ...]

    @property
    def size(self) -> int:
        return len(self.peer_ids)

    def index_of(self, peer_id: PeerID) -> int:
        return self.peer_ids.index(peer_id)


@dataclass(frozen=True)
class GroupAssembled:
    """Leader → each follower: the group is final; begin all-reduce."""

    group: GroupInfo


@dataclass(frozen=True)
class GroupDisbanded:
    """Leader → its followers: it will not lead; go to ``redirect_to`` if given."""

    leader_id: PeerID
    redirect_to: Declaration | None = None


@dataclass(frozen=True)
class LeaveGroup:
    """Follower (or requester) → leader: drop me, I no longer wait for you."""

    follower_id: PeerID
    leader_id: PeerID


@dataclass(frozen=True)
class Redirected:
    """Waiting peer → the leader it waits on: "I pointed these peers at you" (the requesters
    it redirected there, and the peers they named as theirs). The leader holds its group
    open for them as for :attr:`JoinRequest.bringing` (rule 4); a peer that waits itself
    passes them on to its own leader."""

    follower_id: PeerID
    peer_ids: tuple[PeerID, ...]


Notice = GroupAssembled | GroupDisbanded | LeaveGroup | Redirected


# ----------------------------------------------------------------- commands (out)


@dataclass(frozen=True)
class Publish:
    """Put (or replace) this declaration in gossip; keep it until ``expires_at`` or retracted."""

    declaration: Declaration
    expires_at: float | None


@dataclass(frozen=True)
class Retract:
    """Remove this declaration from gossip (or let it expire early)."""

    declaration: Declaration


@dataclass(frozen=True)
class SendRequest:
    """Send ``request`` to ``to``; feed the answer to :meth:`Matchmaker.on_join_response`,
    or a connection failure to :meth:`Matchmaker.on_request_failed`."""

    to: PeerID
    request: JoinRequest


@dataclass(frozen=True)
class Reply:
    """Answer the join request received from ``to`` with ``response``."""

    to: PeerID
    response: JoinResponse


@dataclass(frozen=True)
class Notify:
    """Send a one-way notice; deliver it at ``to`` with :meth:`Matchmaker.on_notice`."""

    to: PeerID
    message: Notice


@dataclass(frozen=True)
class BeginAllreduce:
    """Terminal success of this attempt: run the all-reduce with ``group``."""

    group: GroupInfo


class FailureReason(enum.Enum):
    DEADLINE = "deadline"  # no group of at least min_group_size before the deadline
    CANCELLED = "cancelled"


@dataclass(frozen=True)
class Failed:
    """Terminal failure of this attempt."""

    reason: FailureReason
    detail: str = ""


Command = Publish | Retract | SendRequest | Reply | Notify | BeginAllreduce | Failed


class MatchState(enum.Enum):
    IDLE = "idle"  # no attempt yet; refuses requests
    LOOKING = "looking"  # leads (may have followers); seeks an earlier leader to join
    REQUESTING = "requesting"  # a join request to an earlier leader is in flight
    FOLLOWING = "following"  # accepted by a leader; waiting for it to assemble
    GROUPED = "grouped"  # terminal: BeginAllreduce emitted
    FAILED = "failed"  # terminal: Failed emitted
