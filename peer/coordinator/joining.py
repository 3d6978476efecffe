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
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from peer.coordinator.client import CoordinatorClient, JoinAnswer, JoinChallenge
from peer.coordinator.responses import when_allowed
from peer.coordinator.session import CoordinatorSession
from peer.exceptions import SwarmgradError
from peer.formats.identity import Certificate, CertificateAuth, CertificateVerifier, Identity
from peer.formats.payloads import RendezvousPeer
from peer.transport.port_mapping import PortMapping, map_ports, serves_the_internet

if TYPE_CHECKING:  # imported where a node is made: `import peer.coordinator` stays light
    from peer.node import Node

__all__ = ["Membership", "NodeOptions", "join_run", "listening_ports", "path_of"]


@dataclass(frozen=True)
class NodeOptions:
    """Where the node listens, and whether it only dials out."""

    host: str = "0.0.0.0"
    port: int = 0
    bulk_port: int = 0
    client_mode: bool = False
    #: behind a NAT, punch direct links to the other peers behind NATs (the coordinator is
    #: the rendezvous) instead of only dialing out; ``punch_port`` 0 takes any free port
    punch: bool = True
    punch_port: int = 0
    #: ask the home router (UPnP-IGD) to forward the node's ports before the reachability
    #: check (:mod:`peer.transport.port_mapping`); the forwards are removed on close
    port_mapping: bool = True


@dataclass
class Membership:
    """A joined peer: the coordinator's client, the join answer (with the certificate in
    use), the node and the session. ``reachability`` says, in words, how others reach it."""

    client: CoordinatorClient
    answer: JoinAnswer
    node: Node
    session: CoordinatorSession
    reachability: str
    #: the ports the home router forwards to this peer, if it asked and got them
    mapping: PortMapping | None = None

    def close(self) -> None:
        """Flush the session, shut the node down, remove the router's forwards and close
        the client. Idempotent."""
        with contextlib.suppress(Exception):
            self.session.close()
        self.node.shutdown()
        if self.mapping is not None:
            self.mapping.close()
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
    node, answer, reachability, mapping = _start_node(client, answer, identity, node_options)
    try:
        session = _start_session(client, answer, node, on_status, on_credentials_lost)
    except BaseException:
        node.shutdown()
        if mapping is not None:
            mapping.close()
        raise
    return Membership(client, answer, node, session, reachability, mapping)


def _node(
    answer: JoinAnswer,
    identity: Identity,
    options: NodeOptions,
    client_mode: bool,
    punch_port: int | None = None,
    relays: tuple[str, ...] = (),
) -> Node:
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
        punch_port=punch_port,
        relays=relays,
    )


def _start_node(
    client: CoordinatorClient, answer: JoinAnswer, identity: Identity, options: NodeOptions
) -> tuple[Node, JoinAnswer, str, PortMapping | None]:
    """The node, listening if others can reach it, else in client mode; the join answer,
    with a client's certificate in the second case; the reachability in words; and the
    ports the home router forwards, if it was asked and the forward reaches the node."""
    if options.client_mode:
        node = _node(answer, identity, options, client_mode=True)
        return node, answer, "client mode: dialing out only, as asked", None
    node = _node(
        answer,
        identity,
        options,
        client_mode=False,
        punch_port=options.punch_port if options.punch else None,
    )
    mapping = None
    try:
        port, bulk_port = listening_ports(node)
        if options.port_mapping and serves_the_internet(client.url):
            mapping = map_ports([port, bulk_port or 0])
        # a volunteer restarted within the probe interval is told when: wait, as for the join
        reach = when_allowed(
            lambda: client.check_reachability(
                answer.peer_token, answer.run_id, port, bulk_port, punch_port=node.punch_port
            )
        )
    except BaseException:
        node.shutdown()
        if mapping is not None:
            mapping.close()
        raise
    if reach.reachable and reach.address:
        node.announce([reach.address])
        if mapping is not None:
            return (
                node,
                answer,
                f"reachable at {reach.address} (the router forwards it, by UPnP)",
                mapping,
            )
        return node, answer, f"reachable at {reach.address}", None
    if mapping is not None:  # forwarded, yet the coordinator could not dial in: not ours
        mapping.close()
    if reach.punch_address:
        ports = " and ".join(str(p) for p in (port, bulk_port) if p)
        said = (
            f"behind a NAT at {reach.host}: peers behind NATs link to it by hole punching"
            + (", the others through a relay" if answer.relays else "")
            + f"; forward TCP ports {ports} to let every peer reach it directly"
        )
        if answer.relays:
            # again, registered with the relays, punching from the port the coordinator
            # now names for it
            punch_port = node.punch_port
            node.shutdown()
            node = _node(
                answer, identity, options, False, punch_port=punch_port, relays=answer.relays
            )
        relayed = [a for a in node.visible_addresses if a.startswith("relay://")]
        node.announce([reach.punch_address, *relayed])
        return node, answer, said, None
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
    return _node(answer, identity, options, client_mode=True), answer, reachability, None


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
        on_rendezvous=_introducer(node) if _punches(node) else None,
        on_credentials_lost=on_credentials_lost,
        status=answer.status,
    )


def _punches(node: Node) -> bool:
    """Whether ``node`` takes the rendezvous's list: a node that punches, behind a NAT or
    public (a public one reaches the peers behind NATs through their relays)."""
    return node.punch_port is not None


def _introducer(node: Node) -> Callable[[list[RendezvousPeer]], None]:
    """Hands the coordinator's rendezvous list to ``node``, with each peer's relay
    addresses for a pair the punch does not get through (an entry that is not a valid
    endpoint is left out: the list is the coordinator's word, but checked all the same)."""
    from peer.transport.punch import PunchEndpoint

    def introduce(peers: list[RendezvousPeer]) -> None:
        endpoints, fallbacks = [], {}
        for peer in peers:
            with contextlib.suppress(ValueError):
                endpoints.append(PunchEndpoint(peer.host, peer.port, peer.peer_id))
                fallbacks[peer.peer_id] = [
                    a
                    for a in peer.relays
                    if a.startswith("relay://") and a.endswith(f"/{peer.peer_id}")
                ]
        node.introduce(endpoints, fallbacks)

    return introduce


def path_of(announced: Sequence[str], links: Mapping[str, int], *, mapped: bool = False) -> str:
    """How a peer takes part, in one word, from the addresses it announces and its open
    links by kind (:meth:`peer.Node.link_kinds`): ``public`` (others dial it), ``mapped``
    (others dial it through the ports its router forwards: ``mapped``), ``punched``
    (behind a NAT, with links punched through), ``relayed`` (behind a NAT, through relays
    only), ``dialing out`` (behind a NAT or in client mode, linked only to peers it
    dialed), or ``unreachable`` (no link at all)."""
    if any(a.startswith(("ws://", "wss://")) for a in announced):
        return "mapped" if mapped else "public"
    if links.get("punched"):
        return "punched"
    if links.get("relayed"):
        return "relayed"
    if links.get("direct"):
        return "dialing out"
    return "unreachable"
