"""Roles from the run's certificates are enforced in rounds, whatever a member claims.

A member whose certificate makes it a ``client`` but which claims to serve (and so to
reduce a span of the vector) gets no span from the honest members: the averages it sends
for the span it took are refused, and the honest members end on the same values, averaged
by honest reducers only. Over WebSocket on loopback, in certificate mode.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import numpy as np
import pytest
import torch

from peer import DecentralizedAverager, Node
from peer.averaging.allreduce.round import ButterflyRound
from peer.averaging.allreduce.runner import AllreduceRunner
from peer.averaging.allreduce.send import RoundSending
from peer.formats.identity import Certificate, CertificateAuth, CertificateVerifier, Identity
from peer.wire import Frame
from tests.peer.averaging.conftest import step_all, wait_for

RUN = "roles"
FAST = {"gossip_period": 0.2}


class _TamperingSending(RoundSending):
    """Sends 1e6 in place of every average it reduced."""

    def _frame(self, kind: str, r: int, index: int, count: int = 1) -> Frame:
        frame = super()._frame(kind, r, index, count)
        if kind != "avg":
            return frame
        size = memoryview(frame.payload).nbytes // 4
        return Frame(frame.type, frame.fields, np.full(size, 1e6, dtype=np.float32).tobytes())


class _TamperingRound(ButterflyRound):
    sending_class = _TamperingSending


class _TamperingRunner(AllreduceRunner):
    round_class = _TamperingRound


class _TamperingAverager(DecentralizedAverager):
    runner_class = _TamperingRunner


def _credentials(authority: Identity, role: str) -> tuple[Identity, CertificateAuth]:
    identity = Identity()
    certificate = Certificate.issue(
        authority,
        run_id=RUN,
        public_key=identity.public_key,
        role=role,
        expires_at=time.time() + 600,
    )
    return identity, CertificateAuth(
        certificate.to_bytes(), CertificateVerifier(authority.public_key, RUN)
    )


def test_a_client_that_claims_to_reduce_gets_no_span(caplog: pytest.LogCaptureFixture) -> None:
    authority = Identity()
    roles = ["peer", "peer", "client"]  # the client listens and claims a span all the same
    nodes: list[Node] = []
    averagers: list[DecentralizedAverager] = []
    tensors = [[torch.full((3000,), float(i))] for i in range(3)]
    try:
        for role in roles:
            identity, auth = _credentials(authority, role)
            initial = nodes[0].visible_addresses if nodes else None
            nodes.append(Node(initial, identity=identity, auth=auth, **FAST))
        assert wait_for(lambda: all(len(n.members()) == 3 for n in nodes), 15)
        options: dict[str, Any] = {"prefix": "roles", "target_group_size": 3}
        classes = [DecentralizedAverager, DecentralizedAverager, _TamperingAverager]
        for node, t, cls in zip(nodes, tensors, classes, strict=True):
            averagers.append(cls(t, node, request_timeout=3.0, start=True, **options))
        with caplog.at_level(logging.WARNING, logger="peer.averaging"):
            step_all(averagers, [{"allow_retries": False}] * 3)
        honest = [tensors[0][0], tensors[1][0]]
        assert torch.equal(honest[0], honest[1]), "the honest members disagree"
        assert bool((honest[0] < 1e5).all()), "an average from the client was taken"
        # every value is a mean over the contributions honest reducers accepted
        assert bool(((honest[0] == 0.5) | (honest[0] == 1.0)).all()), honest[0].unique()
        assert any(
            nodes[2].peer_id in r.getMessage() and "client" in r.getMessage()
            for r in caplog.records
        ), "the client that claimed a span is not named"
    finally:
        for averager in averagers:
            averager.shutdown()
        for node in nodes:
            node.shutdown()
