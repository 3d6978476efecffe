"""Transports: the seam between the node and the network (see :mod:`peer.transport.base`)."""

from __future__ import annotations

from peer.transport.base import Connection, Handler, Listener, Transport
from peer.transport.memory import LinkConditions, MemoryNetwork, MemoryTransport
from peer.transport.websocket import WebSocketTransport

__all__ = [
    "Connection",
    "Handler",
    "LinkConditions",
    "Listener",
    "MemoryNetwork",
    "MemoryTransport",
    "Transport",
    "WebSocketTransport",
]
