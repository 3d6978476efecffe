"""Helpers for averager tests: in-process swarms over WebSocket on loopback."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import pytest
import torch

from peer import DecentralizedAverager, Node
from swarmlab.node_process import wait_until
from tests.conftest import scaled


def wait_for(predicate: Callable[[], Any], timeout: float, interval: float = 0.05) -> Any:
    """:func:`swarmlab.node_process.wait_until` with ``timeout`` scaled for this machine."""
    return wait_until(predicate, scaled(timeout), interval)


class Swarm:
    """``n`` nodes over WebSocket on loopback that all know each other."""

    def __init__(self, n: int, client: Sequence[int] = ()) -> None:
        self.nodes: list[Node] = []
        self.averagers: list[DecentralizedAverager] = []
        first = Node(gossip_period=0.2)
        self.nodes.append(first)
        for i in range(1, n):
            self.nodes.append(
                Node(first.visible_addresses, gossip_period=0.2, client_mode=i in client)
            )
        assert wait_for(lambda: all(len(node.members()) == n for node in self.nodes), 15)

    def add_averagers(
        self, tensors: Sequence[Sequence[torch.Tensor]], **kwargs: Any
    ) -> list[DecentralizedAverager]:
        """One averager per node over ``tensors``, with ``kwargs``; ``per_peer`` (a dict per
        peer) adds or overrides keyword arguments, and its ``averager_class`` key builds that
        peer from a subclass (e.g. :func:`swarmlab.averager_doubles.averager_with`)."""
        per_peer: list[dict[str, Any]] = kwargs.pop("per_peer", [{}] * len(tensors))
        # request_timeout stays at its default: a busy 2-core CI box answers slowly
        base = dict(prefix="test", min_matchmaking_time=1.0, request_timeout=3.0, start=True)
        base.update(kwargs)
        for node, t, extra in zip(self.nodes, tensors, per_peer, strict=False):
            options = {**base, **extra}
            cls = options.pop("averager_class", DecentralizedAverager)
            self.averagers.append(cls(t, node, **options))
        return self.averagers

    def close(self) -> None:
        for averager in self.averagers:
            averager.shutdown()
        for node in self.nodes:
            node.shutdown()


@pytest.fixture
def make_swarm() -> Iterator[Callable[..., Swarm]]:
    swarms: list[Swarm] = []

    def make(n: int, client: Sequence[int] = ()) -> Swarm:
        swarm = Swarm(n, client)
        swarms.append(swarm)
        return swarm

    yield make
    for swarm in swarms:
        with contextlib.suppress(Exception):
            swarm.close()


def step_all(
    averagers: Sequence[DecentralizedAverager], kwargs: Sequence[dict[str, Any]] | None = None
) -> list[Any]:
    """Step every averager at once; returns each result or the exception it raised."""
    kwargs = kwargs or [{}] * len(averagers)
    controls = [
        a.step(wait=False, **{"timeout": scaled(20), **kw})
        for a, kw in zip(averagers, kwargs, strict=True)
    ]
    out: list[Any] = []
    for control in controls:
        try:
            out.append(control.result(timeout=scaled(60)))
        except Exception as exc:
            out.append(exc)
    return out


def random_tensors(seed: int) -> list[torch.Tensor]:
    """Tensors of awkward shapes: a matrix, a zero-size one, a 0-d and a 1-element one."""
    g = torch.Generator().manual_seed(seed)
    return [
        torch.randn(3, 5, generator=g),
        torch.zeros(0),
        torch.randn((), generator=g),
        torch.randn(1, generator=g),
        torch.randn(1001, generator=g),
    ]
