"""Sixteen nodes as separate OS processes on loopback (DESIGN: real processes for
multi-peer scenarios). Each node is bootstrapped from one other node only."""

from __future__ import annotations

import random
import re
from collections.abc import Iterator

import pytest

from swarmlab.node_process import NodeProcess, wait_until
from tests.conftest import scaled

pytestmark = pytest.mark.slow

N = 16
MEMBER_TTL = 4.0
ARGS = ("--gossip-period", "0.3", "--member-ttl", str(MEMBER_TTL))


@pytest.fixture(scope="module")
def swarm() -> Iterator[list[NodeProcess]]:
    rng = random.Random(0)
    nodes: list[NodeProcess] = []
    try:
        for i in range(N):
            bootstrap = nodes[rng.randrange(i)].addresses[0] if i else None
            nodes.append(NodeProcess(*ARGS, *(("--initial-peer", bootstrap) if bootstrap else ())))
        yield nodes
    finally:
        for node in nodes:
            node.kill()


def test_every_node_sees_every_peer_and_record(swarm: list[NodeProcess]) -> None:
    ids = {node.peer_id for node in swarm}
    for node in swarm:
        assert node.store("hello", f"from {node.peer_id}", ttl=120, subkey=node.peer_id)

    def converged() -> bool:
        for node in swarm:
            record = node.get("hello")
            if set(node.members()) != ids or record is None or set(record["value"]) != ids:
                return False
        return True

    assert wait_until(converged, scaled(30), interval=0.25)
    sample = swarm[5].get("hello")["value"]
    assert all(sample[pid]["value"] == f"from {pid}" for pid in ids)


def test_store_replace_and_expire_everywhere(swarm: list[NodeProcess]) -> None:
    writer = swarm[3]
    assert writer.store("shared", "v1", ttl=30)
    assert wait_until(
        lambda: all((r := n.get("shared")) and r["value"] == "v1" for n in swarm), scaled(15)
    )
    # v2 would expire before v1 does, so it does not replace it (newest expiration wins).
    assert not writer.store("shared", "v2", ttl=3)
    assert all(n.get("shared")["value"] == "v1" for n in swarm)
    assert writer.store("shared", "v3", ttl=40)
    assert wait_until(
        lambda: all((r := n.get("shared")) and r["value"] == "v3" for n in swarm), scaled(15)
    )
    assert writer.store("short-lived", 1, ttl=2)
    assert wait_until(lambda: all(n.get("short-lived") is not None for n in swarm), scaled(15))
    assert wait_until(lambda: all(n.get("short-lived") is None for n in swarm), scaled(15))


def test_sigkilled_node_disappears_and_survivors_stay_quiet(swarm: list[NodeProcess]) -> None:
    victim = swarm[7]
    survivors = [n for n in swarm if n is not victim]
    assert all(victim.peer_id in n.members() for n in survivors)
    victim.kill()
    # Gone from everyone's membership once its record expires (TTL + refresh slack).
    assert wait_until(
        lambda: all(victim.peer_id not in n.members() for n in survivors), scaled(MEMBER_TTL + 15)
    )
    # Survivors keep working.
    survivors[0].store("after-crash", 42, ttl=60)
    assert wait_until(lambda: all(n.get("after-crash") is not None for n in survivors), scaled(15))
    # At most one warning about the lost peer per survivor, and nothing at error level.
    for node in survivors:
        log = node.quit()
        assert not re.search(r"^(ERROR|CRITICAL)", log, re.MULTILINE), log
        warnings = [
            line
            for line in log.splitlines()
            if line.startswith("WARNING") and victim.peer_id in line
        ]
        assert len(warnings) <= 1, warnings
