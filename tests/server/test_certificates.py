"""Point 4: certificates issued at join verify with the run's public key through the peer
library's certificate mode; two peers holding them complete the authenticated handshake and
gossip; a certificate of another run is refused."""

from __future__ import annotations

import base64
import socket
import time
from collections.abc import Callable
from typing import Any

import pytest

from peer import Node
from peer.exceptions import AuthenticationError
from peer.formats.identity import Certificate, CertificateAuth, CertificateVerifier, Identity
from peer.node import get_time
from tests.server.conftest import Api

GOSSIP_DEADLINE_S = 15.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _verifier(run: dict[str, Any]) -> CertificateVerifier:
    return CertificateVerifier(base64.urlsafe_b64decode(run["public_key"]), run["id"])


def _auth(joined: dict[str, Any], run: dict[str, Any]) -> CertificateAuth:
    return CertificateAuth(
        Certificate.from_base64(joined["certificate"]).to_bytes(), _verifier(run)
    )


def _eventually(condition: Callable[[], bool], what: str) -> None:
    """Poll a condition the gossip protocol makes true within a few rounds."""
    deadline = time.monotonic() + GOSSIP_DEADLINE_S
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for {what}")
        time.sleep(0.02)


async def test_certificates_verify_with_the_run_key_only(api: Api) -> None:
    run = await api.create_run("a")
    other = await api.create_run("b")
    token = (await api.create_join_token(run["id"]))["token"]
    joined = await api.join(run["id"], token)
    certificate = Certificate.from_base64(joined.body["certificate"]).to_bytes()

    verified = _verifier(run)(certificate, joined.identity.public_key)
    assert verified.run_id == run["id"] and verified.role == "peer"
    assert verified.expires_at > time.time() + 3600
    with pytest.raises(AuthenticationError, match="different public key"):
        _verifier(run)(certificate, Identity().public_key)
    with pytest.raises(AuthenticationError, match="not signed by this run"):
        _verifier(other)(certificate, joined.identity.public_key)
    forged_run_id = CertificateVerifier(base64.urlsafe_b64decode(run["public_key"]), other["id"])
    with pytest.raises(AuthenticationError, match="certificate is for run"):
        forged_run_id(certificate, joined.identity.public_key)


@pytest.mark.slow
async def test_two_joined_peers_handshake_and_gossip_and_other_runs_are_refused(
    api: Api,
) -> None:
    run = await api.create_run("a")
    other_run = await api.create_run("b")
    token = (await api.create_join_token(run["id"]))["token"]
    other_token = (await api.create_join_token(other_run["id"]))["token"]

    port = _free_port()
    first = await api.join(run["id"], token, addresses=[f"ws://127.0.0.1:{port}"])
    intruder = await api.join(other_run["id"], other_token, addresses=[])

    nodes: list[Node] = []
    try:
        a = Node(
            identity=first.identity, auth=_auth(first.body, run), port=port, gossip_period=0.05
        )
        nodes.append(a)
        assert a.peer_id == first.body["peer_id"]
        # Handed to others only once the probe reached it.
        probe = await api.client.post(
            f"/api/v1/runs/{run['id']}/reachability", json={"port": port}, headers=first.headers
        )
        assert probe.json()["reachable"] is True, probe.text
        second = await api.join(run["id"], token, addresses=[])
        assert [p["peer_id"] for p in second.body["bootstrap"]] == [first.body["peer_id"]]
        b = Node(
            [addr for p in second.body["bootstrap"] for addr in p["addresses"]],
            identity=second.identity,
            auth=_auth(second.body, run),
            gossip_period=0.05,
        )
        nodes.append(b)
        b.store("progress", {"samples": 42}, get_time() + 60)
        _eventually(lambda: a.get("progress") is not None, "the record to reach the first peer")
        assert a.get("progress").value == {"samples": 42}
        assert b.peer_id in a.members()

        # A valid certificate of another run, presented to this run's peers, is refused.
        refused: Node | None = None
        try:
            refused = Node(
                [f"ws://127.0.0.1:{port}"],
                identity=intruder.identity,
                auth=CertificateAuth(
                    Certificate.from_base64(intruder.body["certificate"]).to_bytes(), _verifier(run)
                ),
                gossip_period=0.05,
            )
        except AuthenticationError as exc:
            assert "run" in str(exc)
        else:
            nodes.append(refused)
            refused.store("forged", 1, get_time() + 60)
            b.store("after", 1, get_time() + 60)
            _eventually(lambda: a.get("after") is not None, "a later honest record")
            assert a.get("forged") is None
            assert refused.get("progress") is None
        assert intruder.body["peer_id"] not in a.members()
    finally:
        for node in nodes:
            node.shutdown()
