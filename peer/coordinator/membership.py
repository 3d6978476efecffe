"""Membership of a coordinator's run: join with a token, start an authenticated node, keep a
session. What ``swarmgrad join`` (:class:`peer.volunteer.Volunteer`) and the Lightning
strategy share.

:func:`join_run`, in order: trade the join token (and a signature over the coordinator's
challenge, proof that this process holds ``identity``'s key) for a peer token, a run
certificate, the run's config and bootstrap peers; start a :class:`~peer.Node` authenticated
by the certificate and ask the coordinator to dial it back — reachable, it announces the
address the coordinator saw; not reachable, it starts again in client mode with a client's
certificate; then start a :class:`~peer.coordinator.CoordinatorSession` that renews the
certificate, sends reports and follows the run's status. :meth:`Membership.close` ends all
three.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from peer.coordinator.client import CoordinatorClient, JoinAnswer, JoinChallenge
from peer.coordinator.responses import when_allowed
from peer.coordinator.session import CoordinatorSession
from peer.exceptions import SwarmgradError
from peer.identity import Certificate, CertificateAuth, CertificateVerifier, Identity

if TYPE_CHECKING:  # imported where a node is made: `import peer.coordinator` stays light
    from peer.node import Node

__all__ = ["Membership", "NodeOptions", "join_run", "listening_ports"]


@dataclass(frozen=True)
class NodeOptions:
    """Where the node listens, and whether it only dials out."""

    host: str = "0.0.0.0"
    port: int = 0
    bulk_port: int = 0
    client_mode: bool = False


@dataclass
class Membership:
    """A joined peer: the coordinator's client, the join answer (with the certificate in
    use), the node and the session. ``reachability`` says, in words, how others reach it."""

    client: CoordinatorClient
    answer: JoinAnswer
    node: Node
    session: CoordinatorSession
    reachability: str

    def close(self) -> None:
        """Flush the session, shut the node down and close the client. Idempotent."""
        with contextlib.suppress(Exception):
            self.session.close()
        self.node.shutdown()
        self.client.close()


def listening_ports(node: Node) -> tuple[int, int | None]:
    """The node's WebSocket port and its bulk lanes' port (None without lanes)."""
    from urllib.parse import urlsplit

    port = urlsplit(node.visible_addresses[0]).port
    if port is None:
        raise SwarmgradError("the node listens on no port")
    bulk = node.core.bulk
    return port, None if bulk is None else bulk.port


def join_run(
    client: CoordinatorClient,
    token: str,
    identity: Identity,
    *,
    node_options: NodeOptions = NodeOptions(),
    display_name: str | None = None,
    challenge: JoinChallenge | None = None,
    on_status: Callable[[str], None] | None = None,
    on_credentials_lost: Callable[[str], None] | None = None,
) -> Membership:
    """Join the run ``token`` invites to (see the module docstring). ``challenge`` is one
    already fetched with ``client.join_challenge(token)`` (e.g. to check the task before a
    use of the invite is spent); ``on_status`` is called with the run's status whenever it
    changes, ``on_credentials_lost`` with one line when the coordinator stops accepting the
    peer token (see :class:`~peer.coordinator.CoordinatorSession`). A rate limit (429) is waited out (:func:`~peer.coordinator.responses.when_allowed`).
    Raises :class:`~peer.coordinator.CoordinatorError` subclasses."""
    if challenge is None:
        challenge = when_allowed(lambda: client.join_challenge(token))
    answer = when_allowed(
        lambda: client.join(
            token,
            challenge,
            identity,
            client_mode=node_options.client_mode,
            display_name=display_name,
        )
    )
    node, answer, reachability = _start_node(client, answer, identity, node_options)
    try:
        session = _start_session(client, answer, node, on_status, on_credentials_lost)
    except BaseException:
        node.shutdown()
        raise
    return Membership(client, answer, node, session, reachability)


def _node(answer: JoinAnswer, identity: Identity, options: NodeOptions, client_mode: bool) -> Any:
    from peer.node import Node

    certificate = Certificate.from_base64(answer.certificate)
    verifier = CertificateVerifier(answer.run_public_key, answer.run_id)
    return Node(
        list(answer.bootstrap),
        host=options.host,
        port=options.port,
        bulk_port=options.bulk_port,
        client_mode=client_mode,
        identity=identity,
        auth=CertificateAuth(certificate.to_bytes(), verifier),
    )


def _start_node(
    client: CoordinatorClient, answer: JoinAnswer, identity: Identity, options: NodeOptions
) -> tuple[Any, JoinAnswer, str]:
    """The node, listening if others can reach it, else in client mode; the join answer,
    with a client's certificate in the second case; and the reachability in words."""
    if options.client_mode:
        node = _node(answer, identity, options, client_mode=True)
        return node, answer, "client mode: dialing out only, as asked"
    node = _node(answer, identity, options, client_mode=False)
    try:
        port, bulk_port = listening_ports(node)
        reach = client.check_reachability(answer.peer_token, answer.run_id, port, bulk_port)
    except BaseException:
        node.shutdown()
        raise
    if reach.reachable and reach.address:
        node.announce([reach.address])
        return node, answer, f"reachable at {reach.address}"
    node.shutdown()
    # the coordinator now counts this peer as a client: its certificate says so too
    certificate, expires_at = when_allowed(
        lambda: client.renew_certificate(answer.peer_token, answer.run_id)
    )
    answer = replace(answer, certificate=certificate, certificate_expires_at=expires_at)
    ports = " and ".join(str(p) for p in (port, bulk_port) if p)
    reachability = (
        "not reachable from outside: running in client mode; "
        f"open TCP ports {ports} to help the swarm more"
    )
    return _node(answer, identity, options, client_mode=True), answer, reachability


def _start_session(
    client: CoordinatorClient,
    answer: JoinAnswer,
    node: Node,
    on_status: Callable[[str], None] | None,
    on_credentials_lost: Callable[[str], None] | None = None,
) -> CoordinatorSession:
    def renewed(certificate_b64: str, expires_at: float) -> None:
        certificate = Certificate.from_base64(certificate_b64)
        verifier = CertificateVerifier(answer.run_public_key, answer.run_id)
        node.set_auth(CertificateAuth(certificate.to_bytes(), verifier))

    return CoordinatorSession(
        client,
        run_id=answer.run_id,
        peer_token=answer.peer_token,
        certificate_expires_at=answer.certificate_expires_at,
        on_certificate=renewed,
        on_status=on_status or (lambda status: None),
        on_revocations=node.revoke,
        needs_bootstrap=lambda: node.num_links == 0,
        on_bootstrap=node.add_initial_peers,
        on_credentials_lost=on_credentials_lost,
        status=answer.status,
    )
