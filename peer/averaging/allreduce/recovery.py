"""Survivors finish a dead reducer's span: the plan of a round's recovery, without I/O.

A reducer that dies mid-round leaves its unfinished parts at each member's own values. Each
member keeps a copy of those values (:class:`Orphans`); after the round the survivors run a
second, short butterfly round over those parts only (same machine and rules), reduced by
one heir: the first non-auxiliary survivor in group order that reduced a span. If the heir
dies too, the others recover its parts in turn with the next heir. The recovery's group id
is the main group's id plus a digest of the plan, so only members that agree on the plan
meet. Pure functions and plain values; the driver is
:class:`~peer.averaging.allreduce.runner.AllreduceRunner`.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from peer.averaging.allreduce.partition import Partition
from peer.averaging.allreduce.vocabulary import MemberInfo
from peer.averaging.matchmaking.messages import GroupInfo

__all__ = ["RECOVERY_ID_BYTES", "Orphans", "RecoveryPlan", "is_recovery_of", "plan_recovery"]

#: bytes of the plan's digest appended to the main group's id
RECOVERY_ID_BYTES = 8


@dataclass
class Orphans:
    """This member's own values of the parts each dead reducer left open, kept when it gave
    the reducer up: reducer index → {part index: copy of the own values}."""

    parts: dict[int, dict[int, torch.Tensor]] = field(default_factory=dict)

    def keep(self, reducer: int, index: int, values: torch.Tensor) -> None:
        self.parts.setdefault(reducer, {})[index] = values.detach().clone()

    def __bool__(self) -> bool:
        return any(self.parts.values())


@dataclass(frozen=True)
class RecoveryPlan:
    """A recovery round as one member plans it (alike on every member whose view agrees).

    ``group``: the survivors, in the main group's order, under the recovery's id;
    ``members``: their metadata; ``slots``: ``(reducer, part index, start, stop)`` of the main
    flat vector, in the order their values are laid out back to back in the recovery's
    vector."""

    group: GroupInfo
    members: tuple[MemberInfo, ...]
    slots: tuple[tuple[int, int, int, int], ...]
    #: the survivors' metadata as the round had it: whom a recovery of the recovery (its
    #: heir died too) chooses its heir from
    candidates: tuple[MemberInfo, ...] = ()

    @property
    def numel(self) -> int:
        return sum(stop - start for _, _, start, stop in self.slots)

    def gather(self, orphans: Orphans, dtype: torch.dtype) -> torch.Tensor:
        """The recovery's flat vector: this member's own values of the open parts."""
        if not self.slots:
            return torch.empty(0, dtype=dtype)
        return torch.cat([orphans.parts[r][i].to(dtype) for r, i, _, _ in self.slots])

    def pieces(self, flat: torch.Tensor) -> list[tuple[int, int, torch.Tensor]]:
        """``(start, stop, values)`` of the main vector, cut from the recovery's ``flat``."""
        out = []
        at = 0
        for _, _, start, stop in self.slots:
            out.append((start, stop, flat[at : at + stop - start]))
            at += stop - start
        return out


def plan_recovery(
    group: GroupInfo,
    members: Sequence[MemberInfo],
    partition: Partition,
    orphans: Orphans,
    left: set[str],
    candidates: Sequence[MemberInfo] | None = None,
) -> RecoveryPlan | None:
    """The recovery round of a round whose reducers in ``orphans`` died (``left``: the
    members this one saw leave), or None if there is nothing to finish or no one to finish
    it with (a survivor alone keeps its own values). ``candidates``: the members' metadata
    the heir is chosen by (default ``members``; a recovery's own recovery passes the
    original round's, since a recovery gives every member but its heir no span).

    A reducer that dies mid-round (silent for ``reducer_timeout``, or its link broken) leaves the
    parts of its span whose averages had not come yet at each member's own values, so the members
    would leave the round disagreeing there. Each member keeps a copy of its own values of those
    parts when it gives the reducer up (:class:`Orphans`); once the round is over, the survivors run
    a second, short butterfly round among themselves over those parts only (the same machine,
    :class:`~peer.averaging.allreduce.round.ButterflyRound`, with every rule of a round: the robust
    aggregator and its pair rule, weight bounds, exclusions), and each writes the result into the
    slots the dead reducer left. One heir reduces every open part: the first survivor in the group's
    order that reduced a span and is not auxiliary, so a part of the round is averaged whole or kept
    whole. If the heir dies too, its parts are left open in the recovery, and the others recover
    them in turn with the next heir, up to ``MAX_RECOVERY_DEPTH`` recoveries deep (the runner's):
    past that the parts keep each member's own values.

    Members meet in that round only if they agree on it: its group id is the main group's id
    followed by a digest of the plan (the survivors, and for each dead reducer the parts left
    open), so a member whose view differs (it had every average of the dead reducer, or gave up
    another member) is not in the same recovery round, and frames of a recovery it does not run
    are not taken for its own.
    """
    candidates = members if candidates is None else candidates
    open_parts = {r: sorted(parts) for r, parts in orphans.parts.items() if parts}
    if not open_parts:
        return None
    survivors = [i for i, p in enumerate(group.peer_ids) if p not in left]
    if len(survivors) < 2:
        return None
    slots = tuple(
        (r, i, partition.part(r, i).start, partition.part(r, i).stop)
        for r in sorted(open_parts)
        for i in open_parts[r]
    )
    digest = hashlib.sha256()
    digest.update(group.group_id)
    for i in survivors:
        digest.update(b"\x00" + group.peer_ids[i].encode())
    for r, i, start, stop in slots:
        digest.update(f"\x01{r}:{i}:{start}:{stop}".encode())
    sub = GroupInfo(
        group_id=group.group_id + digest.digest()[:RECOVERY_ID_BYTES],
        group_key=group.group_key,
        leader=group.peer_ids[survivors[0]],
        peer_ids=tuple(group.peer_ids[i] for i in survivors),
        gathered=tuple(group.gathered[i] for i in survivors),
        client_mode=tuple(group.client_mode[i] for i in survivors),
    )
    # one heir reduces every open part (the first survivor that reduced a span of the
    # round): a part of the round is then averaged whole or kept whole, never split
    # between two reducers of which one may fail
    # (an auxiliary member keeps its own tensors and runs no recovery: never the heir)
    heir = next(
        (
            i
            for i in survivors
            if not candidates[i].client_mode
            and not candidates[i].auxiliary
            and candidates[i].bandwidth != 0
        ),
        None,
    )
    if heir is None:
        return None
    infos = tuple(
        dataclasses.replace(members[i], bandwidth=candidates[i].bandwidth if i == heir else 0.0)
        for i in survivors
    )
    return RecoveryPlan(sub, infos, slots, tuple(candidates[i] for i in survivors))


def is_recovery_of(group_id: bytes, frame_group: bytes) -> bool:
    """``frame_group`` names a recovery round of the round ``group_id``, or a recovery of
    one (a survivor that dies in a recovery leaves its parts to the others in turn)."""
    extra = len(frame_group) - len(group_id)
    return extra > 0 and extra % RECOVERY_ID_BYTES == 0 and frame_group.startswith(group_id)
