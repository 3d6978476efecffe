"""What the optimizers need of a node, typed: the seam between :mod:`peer.optim` and
:mod:`peer.node`, beside averaging's (:mod:`peer.averaging.seam`).

An optimizer is handed the node as training code holds it (:class:`peer.Node`). It hands the
node on to the averagers it builds (so it is a :class:`~peer.averaging.seam.NodeHandle`) and
reads the swarm's gossip records itself: progress reports, state offers. Anything satisfying
:class:`SwarmNode` can carry the optimizers; mypy checks that the node does.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Protocol

from peer.averaging.seam import NodeHandle
from peer.node.gossip import Subkey, ValueWithExpiration

__all__ = ["SwarmNode"]


class SwarmNode(NodeHandle, Protocol):
    """A node as the optimizers use it: an averager's :class:`NodeHandle`, plus gossip reads
    and writes from the training thread."""

    def get(self, key: str, latest: bool = False) -> ValueWithExpiration[Any] | None:
        """The record under ``key`` in this node's replica (None: none)."""
        ...

    def store(self, key: str, value: object, expiration_time: float, subkey: Subkey = None) -> bool:
        """Store ``value`` under ``key`` (and ``subkey``) until ``expiration_time``."""
        ...

    def members(self) -> Mapping[str, object]:
        """The peers whose membership is live, by peer id (this one included)."""
        ...


if TYPE_CHECKING:  # mypy checks that the node is what the optimizers take it for
    from peer.node import Node

    def _node(node: Node) -> SwarmNode:
        return node
