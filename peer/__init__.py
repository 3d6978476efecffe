"""Swarmgrad peer library: what every volunteer runs.

Layers, lowest first: :mod:`peer.wire` (frames), :mod:`peer.transport` (WebSocket and
in-memory connections), :mod:`peer.identity` (keys, auth modes, certificates),
:mod:`peer.node` (authenticated connections, membership and the gossip store),
:mod:`peer.averaging` (``DecentralizedAverager``: matchmaking, butterfly all-reduce, state
download).
"""

from __future__ import annotations

from peer.averaging.averager import DecentralizedAverager
from peer.averaging.control import AveragingStage, StepControl
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
    "AveragingStage",
    "Certificate",
    "CertificateAuth",
    "CertificateVerifier",
    "DecentralizedAverager",
    "Identity",
    "Node",
    "OpenAuth",
    "StepControl",
    "SwarmKeyAuth",
    "SwarmgradError",
    "ValueWithExpiration",
    "get_time",
]
