"""The butterfly round's vocabulary: its options (:class:`AllreduceConfig`), what each member
told the group (:class:`MemberInfo`), and the commands and frames the machine
(:class:`~peer.averaging.allreduce.round.ButterflyRound`) hands its driver (:class:`Wake`,
:class:`Tell`, :class:`Done`, :class:`Send`, :class:`Idle`). Plain values, no logic beyond
checking the options; :mod:`peer.averaging.allreduce.round` re-exports every name.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass

from peer.averaging.allreduce.robust import check_aggregator
from peer.averaging.exceptions import BadContribution
from peer.wire import Frame

__all__ = [
    "AllreduceConfig",
    "Command",
    "Done",
    "Idle",
    "MemberInfo",
    "Send",
    "Tell",
    "Wake",
]


@dataclass(frozen=True)
class AllreduceConfig:
    """Options of the all-reduce round (seed names: hivemind's ``DecentralizedAverager``)."""

    part_size_bytes: int = 2**19
    sender_timeout: float = 10.0
    reducer_timeout: float = 20.0
    min_vector_size: int = 0
    # a contribution weighing more is refused and its sender excluded (one peer with a huge
    # weight would otherwise be the whole mean)
    max_weight: float = math.inf
    # a member that declared a weight over this factor times the group's median is excluded
    relative_weight_bound: float | None = None
    # how a reducer combines the contributions to a part (peer.averaging.allreduce.robust)
    aggregator: str = "mean"

    def __post_init__(self) -> None:
        if self.part_size_bytes < 1:
            raise ValueError("part_size_bytes must be positive")
        if not self.max_weight > 0:
            raise ValueError("max_weight must be positive")
        bound = self.relative_weight_bound
        if bound is not None and not (1 <= bound < math.inf):
            raise ValueError("relative_weight_bound must be a finite factor of at least 1")
        check_aggregator(self.aggregator)
        if self.sender_timeout <= 0 or self.reducer_timeout <= 0:
            raise ValueError("sender_timeout and reducer_timeout must be positive")


@dataclass(frozen=True)
class MemberInfo:
    """What a member told the group through the gathered metadata."""

    peer_id: str
    client_mode: bool
    bandwidth: float | None
    auxiliary: bool
    weight: float | None = None  # the weight it declared for the round


# ------------------------------------------------------------------ commands


@dataclass(frozen=True, slots=True)
class Wake:
    """The outbox to ``peer_id`` changed: ask
    :meth:`~peer.averaging.allreduce.round.ButterflyRound.next_send` again."""

    peer_id: str


@dataclass(frozen=True, slots=True)
class Tell:
    """Send ``frame`` to ``peer_id``, best effort (nothing waits for it)."""

    peer_id: str
    frame: Frame


@dataclass(frozen=True, slots=True)
class Done:
    """The round is over for this member; ``error`` if its own values are bad (it left)."""

    error: BadContribution | None = None


Command = Wake | Tell | Done


@dataclass(frozen=True, slots=True)
class Send:
    """The next frame to a member: ``count`` parts from ``index`` on, contributions
    (``kind == "part"``) or averages (``"avg"``). Hand it back to
    :meth:`~peer.averaging.allreduce.round.ButterflyRound.sent` once the transport took it or
    failed."""

    peer_id: str
    kind: str
    index: int
    count: int
    frame: Frame


class Idle(enum.Enum):
    """Nothing to send to a member: not yet (``WAIT``: a :class:`Wake` will say when), or
    never again (``CLOSED``)."""

    WAIT = "wait"
    CLOSED = "closed"
