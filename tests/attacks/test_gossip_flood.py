"""Floods of gossip records: many certified identities filling every peer's store, and a
store so large that one ``want`` reply could not name what another peer lacks. Real nodes
on loopback (WebSocket transport); the attacker's records sit in its own node's store and
travel by ordinary anti-entropy."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import pytest

from peer.formats.identity import Certificate, CertificateAuth, CertificateVerifier, Identity
from peer.node.core import AsyncNode, NodeConfig
from peer.node.gossip import MEMBERS_KEY, GossipStore, Record
from peer.transport.websocket import WebSocketTransport
from swarmlab.node_process import wait_until_async
from tests.attacks.conftest import Attack
from tests.conftest import scaled

FAST = {"gossip_period": 0.2, "member_ttl": 10.0}


async def _start(node: AsyncNode, nodes: list[AsyncNode]) -> AsyncNode:
    nodes.append(node)
    await node.start()
    return node


def _transport() -> WebSocketTransport:
    return WebSocketTransport(max_message_bytes=NodeConfig().limits.max_frame_bytes)


def _messages(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records]


async def test_many_certified_identities_cannot_fill_the_store(
    attack: Attack, caplog: pytest.LogCaptureFixture
) -> None:
    """Fill every peer's gossip store with the records of 16 certified identities"""
    authority = Identity()
    verifier = CertificateVerifier(authority.public_key, "run")

    def certify(identity: Identity) -> bytes:
        return Certificate.issue(
            authority, run_id="run", public_key=identity.public_key, expires_at=time.time() + 3600
        ).to_bytes()

    def node(initial: list[str], identity: Identity, **config: Any) -> AsyncNode:
        return AsyncNode(
            initial,
            transport=_transport(),
            identity=identity,
            auth=CertificateAuth(certify(identity), verifier),
            config=NodeConfig(**{**FAST, **config}),
        )

    cap = 1 << 20
    nodes: list[AsyncNode] = []
    try:
        victim = await _start(node([], Identity(), max_store_bytes=cap), nodes)
        honest = await _start(node(victim.visible_addresses, Identity()), nodes)
        await honest.store("honest.before", 1, honest.now() + 120)
        assert await wait_until_async(
            lambda: victim.store_.get("honest.before", victim.now()), scaled(10)
        )

        # 16 identities, each within the per-owner quota: 64 records of 4 KiB, 4 MiB in all
        mallory = node(victim.visible_addresses, Identity())
        mallory.store_ = GossipStore(max_bytes=64 << 20)
        assert mallory.trust.certificates is not None
        now = time.time()
        for _ in range(16):
            sybil = Identity()
            certificate = certify(sybil)
            mallory.trust.certificates.learn(
                sybil.public_key, certificate, verifier(certificate, sybil.public_key), now
            )
            for i in range(64):
                record = Record.create(sybil, "junk", i, bytes(4096), now + 120, seq=i + 1)
                assert mallory.store_.put(record, now)
        with caplog.at_level(logging.WARNING, logger="peer.node"):
            await _start(mallory, nodes)
            assert await wait_until_async(
                lambda: any(
                    f"over its share of the full gossip store (relayed by {mallory.peer_id})" in m
                    for m in _messages(caplog)
                ),
                scaled(15),
            ), _messages(caplog)
        held = victim.store_.total_bytes
        members = sum(1 for _ in victim.store_.records(MEMBERS_KEY, victim.now()))
        assert held <= cap + members * 1024, held
        attack.outcome(
            f"the victim holds {held >> 10} KiB of its {cap >> 10} KiB cap for 4 MiB offered; "
            "owners past their share are refused and named with their relay"
        )
        await honest.store("honest.after", 2, honest.now() + 120)
        assert await wait_until_async(
            lambda: victim.store_.get("honest.after", victim.now()), scaled(10)
        )
        assert victim.store_.get("honest.before", victim.now()) is not None
        attack.effect("unaffected: the honest member's records, old and new, are all held")
    finally:
        await asyncio.gather(*(n.shutdown() for n in nodes), return_exceptions=True)


async def test_a_store_larger_than_one_want_reply_keeps_links_up(
    attack: Attack, caplog: pytest.LogCaptureFixture
) -> None:
    """Hold more records than one want reply can name, to drop the links of peers"""
    nodes: list[AsyncNode] = []
    try:
        mallory = AsyncNode(transport=_transport(), config=NodeConfig(**FAST))
        now = time.time()
        count = 0
        for _ in range(8):  # within the per-owner quota: 750 records of 1 KiB each
            owner = Identity()
            for i in range(750):
                assert mallory.store_.put(
                    Record.create(owner, "many", i, bytes(1024), now + 120, seq=i + 1), now
                )
                count += 1
        await _start(mallory, nodes)
        with caplog.at_level(logging.WARNING):
            victim = await _start(
                AsyncNode(
                    mallory.visible_addresses, transport=_transport(), config=NodeConfig(**FAST)
                ),
                nodes,
            )
            assert await wait_until_async(
                lambda: len(victim.store_.records("many", victim.now())) == count, scaled(30)
            ), len(victim.store_.records("many", victim.now()))
            dropped = [m for m in _messages(caplog) if "closing link" in m or "lost contact" in m]
            assert not dropped, dropped
        attack.outcome(f"{count} records asked for in batches of at most 4096 ids per reply")
        attack.effect(f"unaffected: the newcomer received all {count} records, no link dropped")
    finally:
        await asyncio.gather(*(n.shutdown() for n in nodes), return_exceptions=True)
