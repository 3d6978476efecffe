"""A bootstrap list that names an address which is no peer: a newcomer dials it a bounded
number of times, then drops it, and joins through the real peers meanwhile. Real nodes on
loopback; the poisoned address is a TCP port that counts the connections it gets."""

from __future__ import annotations

import asyncio
import logging

import pytest

from peer.node.core import AsyncNode, NodeConfig
from peer.transport.websocket import WebSocketTransport
from swarmlab.node_process import wait_until_async
from tests.attacks.conftest import Attack
from tests.conftest import scaled


async def test_a_poisoned_bootstrap_address_is_dialed_a_bounded_number_of_times(
    attack: Attack, caplog: pytest.LogCaptureFixture
) -> None:
    """Hand newcomers a bootstrap address that is no peer, to be dialed every round"""
    dials = 0

    async def count(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal dials
        dials += 1
        writer.close()

    poisoned = await asyncio.start_server(count, "127.0.0.1", 0)
    address = f"ws://127.0.0.1:{poisoned.sockets[0].getsockname()[1]}"
    config = NodeConfig(gossip_period=0.05, member_ttl=10.0, bootstrap_attempts=4)

    def node(initial: list[str]) -> AsyncNode:
        return AsyncNode(
            initial,
            transport=WebSocketTransport(max_message_bytes=config.limits.max_frame_bytes),
            config=config,
        )

    honest = node([])
    newcomer = node([])
    try:
        await honest.start()
        with caplog.at_level(logging.WARNING, logger="peer.node"):
            await newcomer.start()
            await newcomer.add_initial_peers([address, *honest.visible_addresses])
            assert await wait_until_async(
                lambda: address not in newcomer.gossip.initial_peers, scaled(20)
            )
            assert any(
                m.startswith(f"initial peer {address} did not answer 4 times")
                for m in (r.getMessage() for r in caplog.records)
            )
        assert dials == 4
        rounds = newcomer.gossip.rounds
        # many more rounds, with the newcomer alone now and then: no dial of it again
        assert await wait_until_async(lambda: newcomer.gossip.rounds >= rounds + 40, scaled(20))
        assert dials == 4
        attack.outcome(f"dialed {dials} times (the bound), then dropped and named in the log")
        assert honest.peer_id in newcomer.members()
        assert newcomer.peer_id in honest.members()
        attack.effect("unaffected: the newcomer joined through the honest peer meanwhile")
    finally:
        await newcomer.shutdown()
        await honest.shutdown()
        poisoned.close()
        await poisoned.wait_closed()
