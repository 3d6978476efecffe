"""Fixtures of the optimizer tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from peer import Node
from swarmlab.node_process import wait_until
from tests.conftest import scaled


@pytest.fixture
def nodes() -> Iterator[list[Node]]:
    """Two nodes over loopback WebSockets that know each other (a module may define its own
    ``nodes``)."""
    a = Node(gossip_period=0.2)
    b = Node(a.visible_addresses, gossip_period=0.2)
    assert wait_until(lambda: len(a.members()) == len(b.members()) == 2, scaled(15))
    yield [a, b]
    b.shutdown()
    a.shutdown()
