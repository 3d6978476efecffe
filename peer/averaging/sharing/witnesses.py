"""Whether a downloaded state may be used: other donors as witnesses, and the donors this
peer no longer downloads from.

:func:`judge` compares a downloaded state with the digests that up to
:data:`~peer.averaging.sharing.download.CORROBORATORS` other donors report (``avg.state_digest``):
it is **confirmed** when a witness holds the same state, **outvoted** when two witnesses
agree on another one (or, for a peer with its own state, a witness holds that own state),
else **unconfirmed**. A newcomer uses a confirmed or unconfirmed state; a peer with a state
replaces it only with a confirmed one (exceptions: a donor that finished this peer's own
unfinished round, and runs where every donor shares this peer's invite). Witnesses count
by invite, else by volunteer (:func:`witness_of`), not by key. A verdict is **contested**
when another volunteer declares the donor's stage with another state (two honest forks).

:class:`Refusals` remembers the donors whose states were dropped: an outvoted volunteer is
never asked again (unless contested); another refused donor only once it declares a
higher priority.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from peer.averaging.protocol import STATE_DIGEST, STATE_HASH
from peer.averaging.seam import NodeCore
from peer.exceptions import SwarmgradError
from peer.wire import Frame

logger = logging.getLogger("peer.averaging.state")

__all__ = ["Person", "Refusals", "Verdict", "judge", "witness_of"]

#: who stands behind a key: ``("invite", tag)`` or ``("volunteer", name)`` from its
#: certificate, else ``("peer", id)``
Person = tuple[str, str]


def witness_of(core: NodeCore, peer_id: str) -> Person:
    """Who stands behind ``peer_id`` as a witness: the invite its certificate names (a
    shared invite admits a new volunteer per redemption, so the volunteers it admitted count
    as one), else the volunteer it names, else the key itself."""
    invite = core.certified_invite(peer_id)
    if invite is not None:
        return ("invite", invite)
    volunteer = core.certified_volunteer(peer_id)
    return ("volunteer", volunteer) if volunteer is not None else ("peer", peer_id)


@dataclass(frozen=True)
class Verdict:
    """What the witnesses said of a downloaded state: ``kind`` is ``"confirmed"``,
    ``"outvoted"`` or ``"unconfirmed"``; ``why`` says it in words. ``contested``: another
    volunteer declares a priority at least the donor's and holds another state, so the
    donor's claim is not its alone (two sides of a healed split, members of a group whose
    last round ended differently): an outvoted donor is then refused at this priority only,
    as an unconfirmed one is, not for good."""

    kind: str
    why: str
    contested: bool = False


@dataclass
class Refusals:
    """The donors this peer no longer downloads from (the rule is below). Loop-side
    state of one averager; nothing expires before the averager stops.

    :class:`Refusals` remembers, for the averager's lifetime (the run), the donors whose states
    were dropped: an outvoted donor's volunteer is never downloaded from again, and a donor
    whose state was refused otherwise (unconfirmed, or metadata the caller refused) is not
    asked again until it declares a higher priority. One volunteer's claim therefore costs an
    honest peer at most one download.
    """

    #: people outvoted once: never downloaded from again
    people: dict[Person, str] = field(default_factory=dict)
    #: people whose state was refused at a priority: not asked again at it or below
    claims: dict[Person, float] = field(default_factory=dict)
    #: the keys whose states were dropped, for the caller to discount their claims
    peers: set[str] = field(default_factory=set)

    def refuses(self, person: Person, priority: float) -> bool:
        return person in self.people or priority <= self.claims.get(person, -math.inf)

    def outvoted(self, person: Person, peer_id: str, why: str) -> None:
        self.people[person] = why
        self.peers.add(peer_id)

    def refused(self, person: Person, peer_id: str, priority: float) -> None:
        self.claims[person] = max(priority, self.claims.get(person, -math.inf))
        self.peers.add(peer_id)


async def judge(
    core: NodeCore,
    prefix: str,
    donor: str,
    others: Sequence[str],
    digest: bytes,
    timeout: float,
    *,
    own: bytes | None = None,
    refusals: Refusals | None = None,
    priority: float = math.inf,
) -> Verdict:
    """Ask ``others`` (other donors, best first) for their states' digests and judge the
    state of ``digest`` from ``donor`` by the rules below. ``own``: the digest of
    the state this peer holds, when it holds one worth keeping. Witnesses are people:
    keys whose certificates name the donor's volunteer, and volunteers already outvoted,
    are no witnesses, and several keys of one volunteer count as one.

    A donor can serve any weights under any priority, so a downloaded state is compared with what
    other donors hold before it is used (:func:`judge`). Up to
    :data:`~peer.averaging.sharing.download.CORROBORATORS` other donors are asked for the digest of
    the state they would serve now (``avg.state_digest`` → ``avg.state_hash``), and the state is:

    * **confirmed** when a witness holds the same state;
    * **outvoted** when two or more witnesses agree with each other on another state; or, for a
      peer that holds a state of its own (:attr:`Verdict` with ``own``), when a witness holds
      exactly this peer's own state: the swarm at this peer's state stands with it, and the
      donor's newer state is a claim nobody backs;
    * **unconfirmed** otherwise (no other donor answered, or their states all differ).

    A newcomer (nothing of its own to lose) uses a confirmed or an unconfirmed state; a peer
    that holds a state replaces it only with a confirmed one. A peer at sync ``e`` that is
    handed "sync ``e + 1``" by one volunteer therefore keeps its own state unless another
    volunteer holds that same state. One exception: a donor that began sync ``e``'s
    all-reduce with this peer, which did not finish it (a member died while the donor's averages
    were complete), holds that round's result — an extension of this peer's own state — and its
    state of sync ``e + 1`` is judged as a newcomer judges a state (the round's other members
    that missed it hold this peer's state, and do not outvote it for that). The exception
    needs this peer's own round: a volunteer that was not in it cannot use it. Another: when
    every donor came through this peer's own invite (a run that shares one invite), nobody can
    ever confirm a state, and the donors cannot be told apart from this peer itself: a holder
    then judges as a newcomer does, rather than never catch up with the swarm.

    Witnesses count by what is hard to multiply, not by keys: a key counts as the invite its
    certificate names (a shared invite admits a new volunteer per redemption, and they cannot
    be told apart), else as the volunteer it names (:func:`witness_of`). A donor's other keys
    neither confirm nor outvote it, and several keys of one witness that agree count once
    (named in a warning).

    ``priority`` is the donor's declared one; a witness's answer carries its own. A verdict
    that is not confirmed is **contested** when a witness at ``priority`` or above holds
    another state: two volunteers claim the donor's stage with states that differ (forks of
    a healed split), so the donor's claim is not a lone one and is not refused for good.
    """

    async def ask(peer_id: str) -> tuple[bytes, float] | None:
        try:
            reply = await core.request(peer_id, Frame(STATE_DIGEST, {"p": prefix}), timeout)
        except (SwarmgradError, TimeoutError, ValueError):
            return None
        if reply.type != STATE_HASH:
            return None
        return reply.fields["d"], float(reply.fields["e"])

    replies = await asyncio.gather(*(ask(p) for p in others))
    donor_person = witness_of(core, donor)
    held: dict[bytes, set[Person]] = {}  # digest → the people who hold that state
    keys: dict[tuple[bytes, Person], list[str]] = {}  # (digest, person) → peer ids
    contested = False  # another person at the donor's stage holds another state
    for peer_id, reply in zip(others, replies, strict=True):
        if reply is None:
            continue
        answer, declared = reply
        person = witness_of(core, peer_id)
        if person == donor_person:
            logger.info(
                "donor %s and %s belong to the same volunteer: not a witness", donor, peer_id
            )
            continue
        if refusals is not None and person in refusals.people:
            continue
        held.setdefault(answer, set()).add(person)
        keys.setdefault((answer, person), []).append(peer_id)
        contested |= declared >= priority and answer != digest
    for (_, person), peer_ids in keys.items():
        if len(peer_ids) > 1:  # one person's keys agreeing: one witness, however many keys
            logger.warning(
                "peers %s are keys of one volunteer (%s): they count as one witness",
                ", ".join(sorted(peer_ids)),
                person[1],
            )
    if digest in held:
        return Verdict("confirmed", f"{len(held[digest])} other volunteer(s) hold it")
    agreeing = max((len(people) for people in held.values()), default=0)
    if agreeing >= 2:
        return Verdict(
            "outvoted",
            f"{agreeing} other donors hold another state (each a volunteer of its own), "
            "and none holds this one",
            contested,
        )
    if own is not None and own in held:
        return Verdict(
            "outvoted",
            "another volunteer holds this peer's own state, and none holds the donor's",
            contested,
        )
    if held:
        return Verdict(
            "unconfirmed", "the other donors' states differ from it and each other", contested
        )
    return Verdict("unconfirmed", "no other donor could be asked")
