"""A link retired while a large one-way send crosses it: both sides agree before it
closes, so the send arrives whole (memory transport, virtual time)."""

from __future__ import annotations

import asyncio
from dataclasses import replace

from peer.node.core import NodeConfig
from peer.transport.memory import MemoryNetwork
from peer.wire import Frame, Schema
from swarmlab.node_process import wait_until_async
from swarmlab.sim import VirtualTimeLoop
from tests.peer.test_memory_transport import _chain

BIG = 64 << 20  # 64 MiB: at 8 MB/s over 8 s on the wire, longer than request_timeout


def _retire_during_send(vloop: VirtualTimeLoop, *, retired_by_receiver: bool) -> list[int]:
    async def main() -> list[int]:
        net = MemoryNetwork(latency=0.05, bandwidth=8e6)
        config = NodeConfig(
            max_links=2, link_idle_grace=0.0, gossip_period=60.0, member_ttl=600.0, bulk_lanes=False
        )
        server, sender, _ = nodes = await _chain(net, 3, config)
        await wait_until_async(lambda: len(server.pool.all) == 2, timeout=60.0)
        heard: list[int] = []

        async def note(link, frame: Frame) -> None:
            heard.append(len(frame.payload))

        server.register_handler("test.big", Schema(payload=True), note)
        old = sender.pool.by_peer[server.peer_id]
        payload = bytearray(BIG)
        payload[-1] = 7
        # straight on the link, as a round's sender does (no resend over a new link)
        sending = asyncio.ensure_future(old.send(Frame("test.big", {}, payload)))
        await wait_until_async(lambda: old.sending, timeout=10.0)
        await asyncio.sleep(1.0)  # well under way: an eighth of it is on the wire
        assert not sending.done()
        # the link is retired under the send: by the side receiving it, which sees no
        # frame until it is all in, or by the side sending it
        retirer = server if retired_by_receiver else sender
        other = sender if retired_by_receiver else server
        now = asyncio.get_running_loop().time()
        for link in retirer.pool.all:  # the third node's link was just used: not idle
            if link.peer_id != other.peer_id:
                link.last_used = now
        retirer.config = retirer.pool.config = replace(config, max_links=1)

        def retired() -> bool:  # once no request (gossip) waits on it
            retirer.pool.evict_idle()
            return other.peer_id not in retirer.pool.by_peer

        await wait_until_async(retired, timeout=5.0)
        assert not sending.done()  # retired while the send is under way
        await sending  # not cut
        await wait_until_async(lambda: heard, timeout=60.0)
        await wait_until_async(lambda: old.closed, timeout=300.0)  # and then retired
        for node in nodes:
            await node.shutdown()
        return heard

    return vloop.run_until_complete(main())


def test_a_link_retired_by_the_receiver_under_a_64_mib_send_delivers_it_whole() -> None:
    loop = VirtualTimeLoop()
    try:
        assert _retire_during_send(loop, retired_by_receiver=True) == [BIG]
    finally:
        loop.close()


def test_a_link_retired_by_the_sender_under_a_64_mib_send_delivers_it_whole() -> None:
    loop = VirtualTimeLoop()
    try:
        assert _retire_during_send(loop, retired_by_receiver=False) == [BIG]
    finally:
        loop.close()
