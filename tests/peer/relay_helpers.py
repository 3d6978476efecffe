"""Relays for tests: a :class:`~peer.transport.relay_server.RelayServer` on a loop thread of
its own, and run credentials for nodes that use it."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from peer.formats.identity import Certificate, CertificateAuth, CertificateVerifier, Identity
from peer.node.node import LoopThread, Node
from peer.transport.relay import relay_address
from peer.transport.relay_protocol import RelayLimits
from peer.transport.relay_server import RelayServer, StaticRunKeys

RUN = "run"
FAST: dict[str, Any] = dict(gossip_period=0.2, member_ttl=5.0)


class Authority:
    """A run's authority: issues certificates and says which key relays check them with."""

    def __init__(self, run_id: str = RUN) -> None:
        self.identity = Identity()
        self.run_id = run_id

    def credentials(
        self, *, volunteer: str | None = None, expires_in: float = 600
    ) -> tuple[Identity, CertificateAuth]:
        ident = Identity()
        cert = Certificate.issue(
            self.identity,
            run_id=self.run_id,
            public_key=ident.public_key,
            expires_at=time.time() + expires_in,
            volunteer=volunteer,
        )
        verify = CertificateVerifier(self.identity.public_key, self.run_id)
        return ident, CertificateAuth(cert.to_bytes(), verify)

    def keys(self) -> StaticRunKeys:
        return StaticRunKeys({self.run_id: self.identity.public_key})


@contextmanager
def running_relay(
    authority: Authority,
    limits: RelayLimits | None = None,
    server_class: type[RelayServer] = RelayServer,
    **kwargs: Any,
) -> Iterator[RelayServer]:
    """A relay for ``authority``'s run on loopback, on a loop thread of its own."""
    thread = LoopThread("relay")
    server = server_class(authority.keys(), limits=limits, **kwargs)
    try:
        thread.submit(server.start()).result()
        yield server
    finally:
        thread.submit(server.close()).result()
        thread.stop()


def relayed_node(
    authority: Authority,
    relay: RelayServer,
    initial_peers: list[str] | None = None,
    **kwargs: Any,
) -> Node:
    """A node reachable only through ``relay``: it registers there and announces only its
    relay address (its own listener's address is never told to anyone)."""
    ident, auth = authority.credentials()
    return Node(
        initial_peers,
        identity=ident,
        auth=auth,
        relays=[relay.address],
        announce_addresses=[relay_address(relay.address, ident.peer_id)],
        **{**FAST, **kwargs},
    )
