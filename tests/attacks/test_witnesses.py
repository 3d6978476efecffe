"""Witnesses are people: one volunteer's several keys count once when a downloaded state is
checked against the other donors. Real nodes on loopback, in certificate mode, each
certificate naming the volunteer its key belongs to."""

from __future__ import annotations

import logging
import time
from typing import Any

import pytest
import torch

from peer import DecentralizedAverager, Node
from peer.averaging.state import state_key
from peer.identity import Certificate, CertificateAuth, CertificateVerifier, Identity
from tests.attacks.conftest import Attack
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
        self.nodes: list[Node] = []
        self.averagers: list[DecentralizedAverager] = []
        for person in [*people, "newcomer"]:
            identity, auth = _credentials(authority, person)
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
