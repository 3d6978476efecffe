"""The node layer: identity-bound links, membership and the gossip store."""

from __future__ import annotations

from peer.node.core import AsyncNode, Member, NodeConfig
from peer.node.gossip import ValueWithExpiration
from peer.node.node import LoopThread, Node, get_time

__all__ = [
    "AsyncNode",
    "LoopThread",
    "Member",
    "Node",
    "NodeConfig",
    "ValueWithExpiration",
    "get_time",
]
