"""Witnesses are people: one volunteer's several keys, and the volunteers one shared invite
admitted, count once when a downloaded state is checked against the other donors. Real
nodes on loopback, in certificate mode, each certificate naming the volunteer its key
belongs to (and, from a coordinator, the invite that admitted it)."""

from __future__ import annotations

import base64
import logging
import time
from typing import Any

import pytest
import torch

from peer import DecentralizedAverager, Node
from peer.averaging.sharing.download import state_key
from peer.formats.identity import Certificate, CertificateAuth, CertificateVerifier, Identity
from tests.attacks.conftest import Attack, Coordinator
from tests.conftest import scaled
from tests.peer.averaging.conftest import wait_for

HONEST, FORGED = 2.0, -7.0


class _Forger(DecentralizedAverager):
    """Serves weights of its own making (and the digest of what it serves)."""

    def get_current_state(self) -> tuple[Any, list[torch.Tensor]]:
        return {"epoch": 1}, [torch.full((1000,), FORGED)]


def _credentials(authority: Identity, volunteer: str) -> tuple[Identity, CertificateAuth]:
    identity = Identity()
    certificate = Certificate.issue(
        authority,
        run_id="run",
        public_key=identity.public_key,
        expires_at=time.time() + 600,
        volunteer=volunteer,
    )
    return identity, CertificateAuth(
        certificate.to_bytes(), CertificateVerifier(authority.public_key, "run")
    )


class _Donors:
    """Nodes in certificate mode, one per person named (a name twice: two keys of one
    volunteer), each with a state donor (forged or honest) and a newcomer of its own."""

    def __init__(self, people: list[str], forged: set[int], priorities: list[float]) -> None:
        authority = Identity()
        self._start(
            [_credentials(authority, person) for person in [*people, "newcomer"]],
            forged,
            priorities,
        )

    @classmethod
    def with_credentials(
        cls,
        credentials: list[tuple[Identity, CertificateAuth]],
        forged: set[int],
        priorities: list[float],
    ) -> _Donors:
        """The same with keys and certificates given (the last: the newcomer's)."""
        donors = cls.__new__(cls)
        donors._start(credentials, forged, priorities)
        return donors

    def _start(
        self,
        credentials: list[tuple[Identity, CertificateAuth]],
        forged: set[int],
        priorities: list[float],
    ) -> None:
        self.nodes: list[Node] = []
        self.averagers: list[DecentralizedAverager] = []
        for identity, auth in credentials:
            bootstrap = self.nodes[0].visible_addresses if self.nodes else []
            self.nodes.append(Node(bootstrap, identity=identity, auth=auth, gossip_period=0.2))
        assert wait_for(lambda: all(len(n.members()) == len(self.nodes) for n in self.nodes), 15)
        base: dict[str, Any] = dict(
            prefix="test", min_matchmaking_time=1.0, request_timeout=3.0, start=True
        )
        for i, priority in enumerate(priorities):
            kind = _Forger if i in forged else DecentralizedAverager
            donor = kind(
                [torch.full((1000,), HONEST)], self.nodes[i], allow_state_sharing=True, **base
            )
            donor.state_sharing_priority = priority
            self.averagers.append(donor)
        self.newcomer = DecentralizedAverager([torch.zeros(1000)], self.nodes[-1], **base)
        self.averagers.append(self.newcomer)

        def declared() -> bool:
            record = self.newcomer.node.get(state_key("test"))
            return record is not None and len(record.value) >= len(priorities)

        assert wait_for(declared, 15)

    def download(self) -> torch.Tensor:
        found = self.newcomer.load_state_from_peers(timeout=scaled(30))
        assert found is not None
        return found[1][0]

    def close(self) -> None:
        for averager in self.averagers:
            averager.shutdown()
        for node in self.nodes:
            node.shutdown()


def test_two_keys_of_one_volunteer_do_not_outvote_an_honest_donor(
    attack: Attack, caplog: pytest.LogCaptureFixture
) -> None:
    """Two keys of one volunteer outvote an honest state donor

    An honest donor (the top priority) and two machines of one volunteer serving forged
    weights; a newcomer downloads the honest state and asks the two others to vouch for it.
    They hold another state, but they are one person: one witness cannot outvote a donor,
    so the newcomer keeps the honest state, and the two keys are named."""
    donors = _Donors(["alice", "mallory", "mallory"], forged={1, 2}, priorities=[2.0, 1.0, 1.0])
    try:
        with caplog.at_level(logging.WARNING, logger="peer.averaging.state"):
            state = donors.download()
        assert torch.equal(state, torch.full((1000,), HONEST)), "the forged state won"
        honest, *forgers = donors.averagers[:3]
        assert donors.newcomer.last_state_donor == honest.node.peer_id
        named = [r.getMessage() for r in caplog.records if "count as one witness" in r.getMessage()]
        assert named and all(f.node.peer_id in named[0] for f in forgers), named
        assert "mallory" in named[0]
        attack.outcome("the volunteer's two keys counted as one witness, named in a warning")
        attack.effect("the newcomer loaded the honest donor's state")
    finally:
        donors.close()


def test_a_second_key_of_one_volunteer_cannot_vouch_for_its_state(
    attack: Attack, caplog: pytest.LogCaptureFixture
) -> None:
    """A second key of one volunteer vouches for its forged state

    Two machines of one volunteer declare the top priority and serve forged weights; two
    honest volunteers hold the run's state. The forged state is downloaded first: its twin
    holds the same, but a donor's own volunteer is no witness, and the two honest people
    outvote it; the newcomer ends with the honest state."""
    donors = _Donors(
        ["mallory", "mallory", "alice", "bob"], forged={0, 1}, priorities=[9.0, 9.0, 1.0, 1.0]
    )
    try:
        with caplog.at_level(logging.WARNING, logger="peer.averaging.state"):
            state = donors.download()
        assert torch.equal(state, torch.full((1000,), HONEST)), "the forged state won"
        forgers = {a.node.peer_id for a in donors.averagers[:2]}
        dropped = [r.getMessage() for r in caplog.records if "dropped" in r.getMessage()]
        assert dropped and all(any(f in m for f in forgers) for m in dropped), dropped
        attack.outcome("each of its keys' states outvoted by two other volunteers, named")
        attack.effect("the newcomer loaded the honest state")
    finally:
        donors.close()


@pytest.mark.slow
def test_volunteers_of_one_shared_invite_do_not_outvote_an_honest_donor(
    attack: Attack, coordinator: Coordinator, caplog: pytest.LogCaptureFixture
) -> None:
    """Keys joined through one shared invite outvote an honest state donor

    A real coordinator: alice joins through an invite of her own, mallory twice through a
    shared invite (each join a volunteer of its own: the certificates name two volunteers),
    a newcomer through a third. Mallory's two keys serve forged weights; the newcomer
    downloads alice's state (the top priority) and asks them to vouch for it. The
    certificates name the invite that admitted each volunteer, and witnesses count by
    invite: mallory's keys are one witness, which cannot outvote a donor. Guards:
    :func:`peer.averaging.sharing.witnesses.witness_of` counting by the certificate's invite
    (``invite_tag`` in the coordinator's ``issue_certificate``); counted by volunteer, the two
    keys outvote alice and the newcomer loads the forged state."""
    run_id = coordinator.create_run()
    shared = coordinator.invite(run_id, max_uses=10)
    joined = [
        coordinator.join(run_id, coordinator.invite(run_id), client_mode=False),
        coordinator.join(run_id, shared, client_mode=False),
        coordinator.join(run_id, shared, client_mode=False),
        coordinator.join(run_id, coordinator.invite(run_id), client_mode=False),
    ]
    certificates = [Certificate.from_base64(v.joined["certificate"]) for v in joined]
    alice, mallory, mallory_again, newcomer = certificates
    assert mallory.volunteer != mallory_again.volunteer  # a shared invite mints volunteers
    assert mallory.invite is not None and mallory.invite == mallory_again.invite
    assert len({alice.invite, mallory.invite, newcomer.invite}) == 3
    run_key = base64.urlsafe_b64decode(joined[0].joined["run_public_key"] + "==")
    auths = [
        CertificateAuth(c.to_bytes(), CertificateVerifier(run_key, run_id)) for c in certificates
    ]
    donors = _Donors.with_credentials(
        [(v.identity, auth) for v, auth in zip(joined, auths, strict=True)],
        forged={1, 2},
        priorities=[2.0, 1.0, 1.0],
    )
    try:
        with caplog.at_level(logging.WARNING, logger="peer.averaging.state"):
            state = donors.download()
        assert torch.equal(state, torch.full((1000,), HONEST)), "the forged state won"
        assert donors.newcomer.last_state_donor == donors.nodes[0].peer_id
        named = [r.getMessage() for r in caplog.records if "count as one witness" in r.getMessage()]
        assert named and all(n.peer_id in named[0] for n in donors.nodes[1:3]), named
        attack.outcome("the shared invite's two volunteers counted as one witness, named")
        attack.effect("the newcomer loaded the honest donor's state")
    finally:
        donors.close()
