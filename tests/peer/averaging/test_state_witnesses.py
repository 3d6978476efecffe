"""A peer that holds a state of its own replaces it only with one another volunteer
confirms, and a donor whose state was dropped is not downloaded from again
(:mod:`peer.averaging.sharing.witnesses`). Averagers over loopback."""

from __future__ import annotations

import collections
import logging
import time
from typing import Any

import pytest
import torch

from peer import Node
from peer.averaging.averager import DecentralizedAverager
from peer.averaging.sharing.download import StateServer, state_key
from peer.formats.identity import Certificate, CertificateAuth, CertificateVerifier, Identity
from peer.wire import Frame
from swarmlab.averager_doubles import averager_with
from tests.conftest import scaled
from tests.peer.averaging.conftest import wait_for

BASE: dict[str, Any] = dict(
    prefix="test", min_matchmaking_time=1.0, request_timeout=3.0, start=True
)


def _counting(begun: collections.Counter[str]) -> type[StateServer]:
    """A donor side that counts the downloads begun from it, in ``begun``."""

    class Counting(StateServer):
        async def on_begin(self, link: Any, frame: Frame) -> Frame:
            begun[link.peer_id] += 1
            return await super().on_begin(link, frame)

    return Counting


def _donor(
    node: Any, value: float, priority: float, server: type[StateServer] | None = None
) -> DecentralizedAverager:
    """A donor declaring ``priority`` over ``value``; ``server`` serves its state if given."""
    donor = averager_with(state_server=server)(
        [torch.full((100,), value)], node, allow_state_sharing=True, **BASE
    )
    donor.state_sharing_priority = priority
    return donor


def _declared(peer: DecentralizedAverager, donors: list[DecentralizedAverager]) -> bool:
    record = peer.node.get(state_key("test"))
    return record is not None and all(
        getattr(record.value.get(d.node.peer_id), "value", None) == d.state_sharing_priority
        for d in donors
    )


def test_a_lone_donors_newer_state_does_not_replace_a_held_one_and_is_asked_once(
    make_swarm, caplog: pytest.LogCaptureFixture
) -> None:
    """With nobody to confirm it, a donor's newer state is not used by a peer that holds
    one (a newcomer would take it); asked again, the peer does not download it again, until
    the donor declares a higher priority."""
    swarm = make_swarm(2)
    begun: collections.Counter[str] = collections.Counter()
    donor = _donor(swarm.nodes[0], 5.0, 2.0, server=_counting(begun))
    holder = DecentralizedAverager([torch.full((100,), 1.0)], swarm.nodes[1], **BASE)
    swarm.averagers += [donor, holder]
    me = holder.node.peer_id
    assert wait_for(lambda: _declared(holder, [donor]), 15)

    with caplog.at_level(logging.WARNING, logger="peer.averaging.state"):
        assert holder.load_state_from_peers(timeout=scaled(30), holding=True) is None
    assert begun[me] == 1
    assert any("another volunteer confirms" in r.getMessage() for r in caplog.records)
    assert holder.load_state_from_peers(timeout=scaled(30), holding=True) is None
    assert begun[me] == 1, "the refused claim was downloaded again"
    assert donor.node.peer_id in holder.sharing.refused_donors()

    donor.state_sharing_priority = 3.0
    assert wait_for(lambda: _declared(holder, [donor]), 15)
    assert holder.load_state_from_peers(timeout=scaled(30), holding=True) is None
    assert begun[me] == 2


def test_a_newcomer_takes_a_lone_donors_state(make_swarm) -> None:
    swarm = make_swarm(2)
    donor = _donor(swarm.nodes[0], 5.0, 2.0)
    newcomer = DecentralizedAverager([torch.zeros(100)], swarm.nodes[1], **BASE)
    swarm.averagers += [donor, newcomer]
    assert wait_for(lambda: _declared(newcomer, [donor]), 15)
    found = newcomer.load_state_from_peers(timeout=scaled(30))
    assert found is not None and torch.equal(found[1][0], torch.full((100,), 5.0))


def test_a_witness_holding_this_peers_own_state_outvotes_the_donor_for_good(
    make_swarm, caplog: pytest.LogCaptureFixture
) -> None:
    """Another volunteer holds exactly this peer's state and none holds the donor's newer
    one: the donor is outvoted, named, and not downloaded from again at any priority."""
    swarm = make_swarm(3)
    begun: collections.Counter[str] = collections.Counter()
    donor = _donor(swarm.nodes[0], 1000.0, 2.0, server=_counting(begun))
    witness = _donor(swarm.nodes[1], 1.0, 1.0)
    holder = DecentralizedAverager(
        [torch.full((100,), 1.0)], swarm.nodes[2], allow_state_sharing=True, **BASE
    )
    holder.state_sharing_priority = 1.0
    swarm.averagers += [donor, witness, holder]
    me = holder.node.peer_id
    assert wait_for(lambda: _declared(holder, [donor, witness]), 15)

    with caplog.at_level(logging.WARNING, logger="peer.averaging.state"):
        found = holder.load_state_from_peers(timeout=scaled(30), holding=True, min_priority=2.0)
    assert found is None
    dropped = [r.getMessage() for r in caplog.records if "dropped" in r.getMessage()]
    assert dropped and donor.node.peer_id in dropped[0] and "own state" in dropped[0], dropped
    donor.state_sharing_priority = 7.0
    assert wait_for(lambda: _declared(holder, [donor]), 15)
    assert holder.load_state_from_peers(timeout=scaled(30), holding=True) is None
    assert holder.load_state_from_peers(timeout=scaled(30)) is not None  # the witness's
    assert begun[me] == 1, "an outvoted donor was downloaded from again"


def test_a_held_state_is_replaced_by_a_newer_one_another_volunteer_confirms(make_swarm) -> None:
    swarm = make_swarm(3)
    donors = [_donor(swarm.nodes[i], 3.0, 2.0) for i in (0, 1)]
    holder = DecentralizedAverager([torch.full((100,), 1.0)], swarm.nodes[2], **BASE)
    swarm.averagers += [*donors, holder]
    assert wait_for(lambda: _declared(holder, donors), 15)
    found = holder.load_state_from_peers(timeout=scaled(30), holding=True, min_priority=2.0)
    assert found is not None and torch.equal(found[1][0], torch.full((100,), 3.0))


def test_two_forks_of_one_stage_are_refused_at_that_stage_only(
    make_swarm, caplog: pytest.LogCaptureFixture
) -> None:
    """A healed split: two volunteers declare the next stage with states that differ in
    their last bits (their last round ended differently), and the peer beside this one
    holds this peer's own state. The newer state is not used, yet neither donor is refused
    for good: once the two declare a newer stage holding one state, this peer takes it."""
    swarm = make_swarm(4)
    ahead = [_donor(swarm.nodes[0], 3.0, 2.0), _donor(swarm.nodes[1], 3.0 + 1e-6, 2.0)]
    beside = _donor(swarm.nodes[2], 1.0, 1.0)
    holder = DecentralizedAverager(
        [torch.full((100,), 1.0)], swarm.nodes[3], allow_state_sharing=True, **BASE
    )
    holder.state_sharing_priority = 1.0
    swarm.averagers += [*ahead, beside, holder]
    assert wait_for(lambda: _declared(holder, [*ahead, beside]), 15)

    with caplog.at_level(logging.WARNING, logger="peer.averaging.state"):
        assert (
            holder.load_state_from_peers(timeout=scaled(30), holding=True, min_priority=2.0) is None
        )
    said = [r.getMessage() for r in caplog.records]
    assert any("but another volunteer declares its priority" in m for m in said), said
    assert not any("no more" in m for m in said), said

    with ahead[1].get_tensors() as tensors:
        tensors[0].fill_(3.0)  # the next round made them one again
    for donor in ahead:
        donor.state_sharing_priority = 3.0
    assert wait_for(lambda: _declared(holder, ahead), 15)
    found = holder.load_state_from_peers(timeout=scaled(30), holding=True, min_priority=2.0)
    assert found is not None and torch.equal(found[1][0], torch.full((100,), 3.0))


def test_a_donor_serving_this_peers_own_state_changes_nothing(make_swarm) -> None:
    """Nothing to load: the state this peer holds is not handed back (its progress would be
    reset for nothing), and the donor is not refused."""
    swarm = make_swarm(2)
    donor = _donor(swarm.nodes[0], 1.0, 2.0)
    holder = DecentralizedAverager([torch.full((100,), 1.0)], swarm.nodes[1], **BASE)
    swarm.averagers += [donor, holder]
    assert wait_for(lambda: _declared(holder, [donor]), 15)
    assert holder.load_state_from_peers(timeout=scaled(30), holding=True) is None
    assert not holder.sharing.refused_donors()


def test_a_round_mates_state_of_the_round_this_peer_missed_extends_its_own(make_swarm) -> None:
    """A peer that missed a round's result (a member died mid-round) takes the state of the
    next sync from a member that began that round with it, though the round's other
    survivor holds this peer's own state; from a donor that was not in the round, the same
    state is outvoted."""
    swarm = make_swarm(3)
    mate = _donor(swarm.nodes[0], 3.0, 2.0)
    missed_too = _donor(swarm.nodes[1], 1.0, 1.0)
    holder = DecentralizedAverager([torch.full((100,), 1.0)], swarm.nodes[2], **BASE)
    swarm.averagers += [mate, missed_too, holder]
    assert wait_for(lambda: _declared(holder, [mate, missed_too]), 15)
    kwargs: dict[str, Any] = dict(timeout=scaled(30), holding=True, min_priority=2.0)
    found = holder.load_state_from_peers(**kwargs, partners={mate.node.peer_id})
    assert found is not None and torch.equal(found[1][0], torch.full((100,), 3.0))
    assert holder.load_state_from_peers(**kwargs) is None
    assert mate.node.peer_id in holder.sharing.refused_donors()


@pytest.mark.parametrize(("invites", "taken"), [(("shared", "shared"), True), (("a", "b"), False)])
def test_a_holder_whose_donors_all_share_its_invite_takes_their_state(
    invites: tuple[str, str], taken: bool
) -> None:
    """One shared invite: every donor is this peer's own invite, nobody can ever confirm a
    state, and a holder takes it as a newcomer would instead of never catching up. A donor
    of another invite is still a lone claim the holder keeps its own state against."""
    authority = Identity()
    verifier = CertificateVerifier(authority.public_key, "run")
    nodes: list[Node] = []
    for volunteer, invite in enumerate(invites):
        identity = Identity()
        certificate = Certificate.issue(
            authority,
            run_id="run",
            public_key=identity.public_key,
            expires_at=time.time() + 3600,
            volunteer=str(volunteer),
            invite=invite,
        )
        nodes.append(
            Node(
                nodes[0].visible_addresses if nodes else [],
                identity=identity,
                auth=CertificateAuth(certificate.to_bytes(), verifier),
                gossip_period=0.2,
            )
        )
    donor = _donor(nodes[0], 5.0, 2.0)
    holder = DecentralizedAverager([torch.full((100,), 1.0)], nodes[1], **BASE)
    try:
        assert wait_for(lambda: _declared(holder, [donor]), 15)
        assert wait_for(lambda: holder.node.core.certified_invite(donor.node.peer_id), 15)
        found = holder.load_state_from_peers(timeout=scaled(30), holding=True)
        if taken:
            assert found is not None and torch.equal(found[1][0], torch.full((100,), 5.0))
        else:
            assert found is None
    finally:
        for averager in (donor, holder):
            averager.shutdown()
        for node in nodes:
            node.shutdown()
