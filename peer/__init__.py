"""Swarmgrad peer library: what every volunteer runs.

Layers, lowest first: :mod:`peer.wire` (frames), :mod:`peer.transport` (WebSocket and
in-memory connections), :mod:`peer.formats` (keys, auth modes, certificates),
:mod:`peer.node` (authenticated connections, membership and the gossip store),
:mod:`peer.averaging` (``DecentralizedAverager``: matchmaking, butterfly all-reduce, state
download), :mod:`peer.optim` (``DecentralizedOptimizer``/``SGD``/``Adam`` with swarm epochs,
the collaborative ``Optimizer`` with a global target batch size, ``DiLoCo`` (outer rounds
every H local steps), ``HierarchicalModelAverager`` and ``DASO`` over a machine's
``torch.distributed`` world and the swarm).

Every name but the exception and the formats is imported lazily (PEP 562): ``import peer``
(and so ``import peer.formats``, which the coordinator uses) loads neither the node nor its
transports nor torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from peer.exceptions import SwarmgradError
from peer.formats.identity import (
    Certificate,
    CertificateAuth,
    CertificateVerifier,
    Identity,
    OpenAuth,
    SwarmKeyAuth,
)

if TYPE_CHECKING:
    from peer.averaging.averager import DecentralizedAverager
    from peer.averaging.control import AveragingStage, StepControl
    from peer.node import AsyncNode, Node, ValueWithExpiration, get_time
    from peer.optim.collaborative.optimizer import Optimizer
    from peer.optim.decentralized.optimizers import (
        DecentralizedAdam,
        DecentralizedOptimizer,
        DecentralizedSGD,
    )
    from peer.optim.diloco.outer import DiLoCo
    from peer.optim.hierarchy.daso import DASO, DataParallelOptimizer
    from peer.optim.hierarchy.hierarchical import HierarchicalModelAverager

_LAZY = {
    "AsyncNode": "peer.node",
    "Node": "peer.node",
    "ValueWithExpiration": "peer.node",
    "get_time": "peer.node",
    "DecentralizedAverager": "peer.averaging.averager",
    "AveragingStage": "peer.averaging.control",
    "StepControl": "peer.averaging.control",
    "DecentralizedAdam": "peer.optim.decentralized.optimizers",
    "DecentralizedOptimizer": "peer.optim.decentralized.optimizers",
    "DecentralizedSGD": "peer.optim.decentralized.optimizers",
    "Optimizer": "peer.optim.collaborative.optimizer",
    "DASO": "peer.optim.hierarchy.daso",
    "DataParallelOptimizer": "peer.optim.hierarchy.daso",
    "DiLoCo": "peer.optim.diloco.outer",
    "HierarchicalModelAverager": "peer.optim.hierarchy.hierarchical",
}


def __getattr__(name: str) -> object:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'peer' has no attribute {name!r}")
    value: object = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


__all__ = [
    "DASO",
    "AsyncNode",
    "AveragingStage",
    "Certificate",
    "CertificateAuth",
    "CertificateVerifier",
    "DataParallelOptimizer",
    "DecentralizedAdam",
    "DecentralizedAverager",
    "DecentralizedOptimizer",
    "DecentralizedSGD",
    "DiLoCo",
    "HierarchicalModelAverager",
    "Identity",
    "Node",
    "OpenAuth",
    "Optimizer",
    "StepControl",
    "SwarmKeyAuth",
    "SwarmgradError",
    "ValueWithExpiration",
    "get_time",
]
