"""Swarmgrad peer library: what every volunteer runs.

Layers, lowest first: :mod:`peer.wire` (frames), :mod:`peer.transport` (WebSocket and
in-memory connections), :mod:`peer.identity` (keys, auth modes, certificates),
:mod:`peer.node` (authenticated connections, membership and the gossip store).
"""

from __future__ import annotations

from peer.exceptions import SwarmgradError
from peer.identity import (
    Certificate,
    CertificateAuth,
    CertificateVerifier,
    Identity,
    OpenAuth,
    SwarmKeyAuth,
)
from peer.node import AsyncNode, Node, ValueWithExpiration, get_time

__all__ = [
    "AsyncNode",
    "Certificate",
    "CertificateAuth",
    "CertificateVerifier",
    "Identity",
    "Node",
    "OpenAuth",
    "SwarmKeyAuth",
    "SwarmgradError",
    "ValueWithExpiration",
    "get_time",
]
