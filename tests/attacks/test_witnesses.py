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


def test_two_keys_of_one_volunteer_do_not_outvote_an_honest_donor(
    attack: Attack, caplog: pytest.LogCaptureFixture
) -> None:
    """Two keys of one volunteer outvote an honest state donor

    An honest donor (the top priority) and two machines of one volunteer serving forged
    weights; a newcomer downloads the honest state and asks the two others to vouch for it.
    They hold another state, but they are one person: one witness cannot outvote a donor,
    so the newcomer keeps the honest state, and the two keys are named."""
    authority = Identity()
    people = ["alice", "mallory", "mallory", "newcomer"]
    nodes: list[Node] = []
    averagers: list[DecentralizedAverager] = []
    try:
        for person in people:
            identity, auth = _credentials(authority, person)
            bootstrap = nodes[0].visible_addresses if nodes else []
            nodes.append(Node(bootstrap, identity=identity, auth=auth, gossip_period=0.2))
        assert wait_for(lambda: all(len(n.members()) == len(nodes) for n in nodes), 15)
        base: dict[str, Any] = dict(
            prefix="test", min_matchmaking_time=1.0, request_timeout=3.0, start=True
        )
        honest = DecentralizedAverager(
            [torch.full((1000,), HONEST)], nodes[0], allow_state_sharing=True, **base
        )
        averagers.append(honest)
        forgers = [
            _Forger([torch.zeros(1000)], node, allow_state_sharing=True, **base)
            for node in nodes[1:3]
        ]
        averagers += forgers
        newcomer = DecentralizedAverager([torch.zeros(1000)], nodes[3], **base)
        averagers.append(newcomer)
        honest.state_sharing_priority = 2.0
        for forger in forgers:
            forger.state_sharing_priority = 1.0

        def declared() -> bool:
            record = newcomer.node.get(state_key("test"))
            return record is not None and len(record.value) >= 3

        assert wait_for(declared, 15)
        with caplog.at_level(logging.WARNING, logger="peer.averaging.state"):
            found = newcomer.load_state_from_peers(timeout=scaled(30))
        assert found is not None
        assert torch.equal(found[1][0], torch.full((1000,), HONEST)), "the forged state won"
        assert newcomer.last_state_donor == honest.node.peer_id
        named = [r.getMessage() for r in caplog.records if "count as one witness" in r.getMessage()]
        assert named and all(f.node.peer_id in named[0] for f in forgers), named
        assert "mallory" in named[0]
        attack.outcome("the volunteer's two keys counted as one witness, named in a warning")
        attack.effect("the newcomer loaded the honest donor's state")
    finally:
        for averager in averagers:
            averager.shutdown()
        for node in nodes:
            node.shutdown()
