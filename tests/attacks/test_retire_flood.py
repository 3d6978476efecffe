"""A peer floods ``link.retire`` notices over one link while the victim waits on it for a
reply. Real nodes on loopback (WebSocket transport).

Defence guarded: a link is closed once however often it is retired
(``LinkPool.on_retire``). Without it every notice started one more close task waiting for
the pending reply: 500 notices, 500 tasks, each alive for up to the request timeout."""

from __future__ import annotations

import asyncio

from peer.node.core import AsyncNode, NodeConfig
from peer.node.pool import LINK_RETIRE
from peer.transport.websocket import WebSocketTransport
from peer.wire import Frame, Schema
from swarmlab.node_process import wait_until_async
from tests.attacks.conftest import Attack
from tests.conftest import scaled

FLOOD = 500


def _node(initial: list[str] | None = None) -> AsyncNode:
    config = NodeConfig(gossip_period=0.2, request_timeout=scaled(10))
    transport = WebSocketTransport(max_message_bytes=config.limits.max_frame_bytes)
    return AsyncNode(initial or [], transport=transport, config=config)


def _retiring(node: AsyncNode) -> int:
    return sum(1 for t in node._tasks if t.get_name().endswith("-retired") and not t.done())


async def test_a_retire_flood_costs_one_close_while_a_request_is_pending(attack: Attack) -> None:
    """Flood a peer with link.retire notices while it waits for a reply on that link"""
    nodes: list[AsyncNode] = []
    try:
        mallory = _node()
        answer = asyncio.Event()

        async def stall(link: object, frame: Frame) -> Frame:
            await answer.wait()  # holds the victim's request pending
            return Frame("stall.ok")

        mallory.register_handler("stall", Schema(), stall)
        nodes.append(mallory)
        await mallory.start()
        victim = _node(mallory.visible_addresses)
        victim.registry.register("stall.ok", Schema())

        async def probe(link: object, frame: Frame) -> Frame:
            return Frame("probe.ok")

        victim.register_handler("probe", Schema(), probe)
        mallory.registry.register("probe.ok", Schema())
        nodes.append(victim)
        await victim.start()
        pending = asyncio.ensure_future(victim.request(mallory.peer_id, Frame("stall")))
        assert await wait_until_async(
            lambda: (
                victim.peer_id in mallory.pool.by_peer and mallory.pool.by_peer[victim.peer_id].busy
            ),
            scaled(10),
        )
        link = mallory.pool.by_peer[victim.peer_id]
        for _ in range(FLOOD):
            await link.send(Frame(LINK_RETIRE))
        # frames are read in order: once a request sent after the notices is answered, the
        # victim has handled every one of them
        assert (await link.request(Frame("probe"), scaled(10))).type == "probe.ok"
        tasks = _retiring(victim)
        assert tasks <= 1, tasks
        answer.set()
        reply = await asyncio.wait_for(pending, scaled(10))
        assert reply.type == "stall.ok"
        attack.outcome(f"{FLOOD} notices on one link: {tasks} close task")
        attack.effect("the pending request is still answered over the retired link")
    finally:
        await asyncio.gather(*(n.shutdown() for n in nodes), return_exceptions=True)
