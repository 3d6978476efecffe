"""Attacks before authentication: large frames under a replayed certificate or a guessed
swarm key, idle connections holding every handshake place, and a flood of connections to
the bulk-lane port. Real nodes on loopback (WebSocket transport); the attacker speaks the
wire protocol with a plain WebSocket client. The attacker's connections come from
127.0.0.2 where a limit per source matters (the whole of 127.0.0.0/8 is loopback)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import sys
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest
from websockets.asyncio.client import connect as ws_connect
from websockets.exceptions import ConnectionClosed as WsClosed
from websockets.protocol import State as WsState

from peer.formats.identity import (
    Authenticator,
    Certificate,
    CertificateAuth,
    CertificateVerifier,
    Identity,
    SwarmKeyAuth,
)
from peer.node.core import AsyncNode, NodeConfig
from peer.node.links import HELLO
from peer.transport.websocket import WebSocketTransport
from peer.wire import Frame, Schema, encode_frame
from swarmlab.node_process import NodeProcess, wait_until, wait_until_async
from tests.attacks.conftest import Attack
from tests.conftest import scaled

ATTACKER_HOST = "127.0.0.2"


async def _node(
    initial: list[str] | None = None, *, auth: Authenticator | None = None, **config: Any
) -> AsyncNode:
    cfg = NodeConfig(**{"gossip_period": 0.2, "member_ttl": 10.0, **config})
    node = AsyncNode(
        initial or [],
        transport=WebSocketTransport(max_message_bytes=cfg.limits.max_frame_bytes),
        auth=auth,
        config=cfg,
    )
    await node.start()
    return node


@contextlib.asynccontextmanager
async def _nodes(*nodes: AsyncNode) -> AsyncIterator[None]:
    try:
        yield
    finally:
        await asyncio.gather(*(n.shutdown() for n in nodes), return_exceptions=True)


async def _gossip_flows(sender: AsyncNode, receiver: AsyncNode, value: int) -> bool:
    await sender.store("honest", value, sender.now() + 60)
    deadline = time.monotonic() + scaled(15)
    while time.monotonic() < deadline:
        found = await receiver.get("honest")
        if found is not None and found.value == value:
            return True
        await asyncio.sleep(0.05)
    return False


async def _logged(caplog: pytest.LogCaptureFixture, *parts: str) -> bool:
    """Whether a line naming every one of ``parts`` is logged within a few seconds."""
    deadline = time.monotonic() + scaled(5)
    while time.monotonic() < deadline:
        if any(all(p in r.getMessage() for p in parts) for r in caplog.records):
            return True
        await asyncio.sleep(0.02)
    return False


def _hello(public_key: bytes, mode: str, credential: bytes = b"") -> bytes:
    """A hello as a node sends it, for a key the sender does not hold."""
    return encode_frame(
        Frame(
            HELLO,
            {
                "public_key": public_key,
                "nonce": os.urandom(32),
                "mode": mode,
                "credential": credential,
                "addresses": [],
                "client_mode": True,
                "encrypt": True,
                "kx": os.urandom(32),
            },
        )
    )


async def _send_large_instead_of_auth(address: str, hello: bytes, size: int) -> tuple[int, int]:
    """Say ``hello``, read the node's ``auth``, then send ``size`` bytes where ours belongs;
    the close code the node ends the connection with, and the attacker's port (which the
    node's log names)."""
    ws = await ws_connect(address, max_size=None, compression=None)
    port = ws.local_address[1]
    try:
        await ws.recv()  # the node's hello
        await ws.send(hello)
        await asyncio.wait_for(ws.recv(), scaled(30))  # its auth: it read our hello
        with contextlib.suppress(WsClosed):
            await ws.send(bytes(size))
        with contextlib.suppress(WsClosed):
            while True:
                await asyncio.wait_for(ws.recv(), scaled(30))
    finally:
        if ws.state is not WsState.CLOSED:
            await ws.close()
    assert ws.close_code is not None
    return ws.close_code, port


async def test_a_replayed_certificate_lifts_no_frame_limit(
    attack: Attack, caplog: pytest.LogCaptureFixture
) -> None:
    """Replay a member's certificate to send large frames before authenticating"""
    authority = Identity()
    verifier = CertificateVerifier(authority.public_key, "run")

    def certified() -> tuple[Identity, bytes]:
        identity = Identity()
        certificate = Certificate.issue(
            authority, run_id="run", public_key=identity.public_key, expires_at=time.time() + 3600
        )
        return identity, certificate.to_bytes()

    victim_id, victim_cert = certified()
    honest_id, honest_cert = certified()
    victim = AsyncNode(
        transport=WebSocketTransport(max_message_bytes=64 << 20),
        identity=victim_id,
        auth=CertificateAuth(victim_cert, verifier),
        config=NodeConfig(gossip_period=0.2, member_ttl=10.0),
    )
    await victim.start()
    honest = AsyncNode(
        victim.visible_addresses,
        transport=WebSocketTransport(max_message_bytes=64 << 20),
        identity=honest_id,
        auth=CertificateAuth(honest_cert, verifier),
        config=NodeConfig(gossip_period=0.2, member_ttl=10.0),
    )
    await honest.start()
    async with _nodes(victim, honest):
        # the certificate any member's hello shows, under that member's public key
        hello = _hello(honest_id.public_key, "certificate", honest_cert)
        with caplog.at_level(logging.INFO, logger="peer.node"):
            code, port = await _send_large_instead_of_auth(
                victim.visible_addresses[0], hello, 8 << 20
            )
            # 1009: the message was refused at its first frame, before it was buffered
            assert code == 1009, code
            assert await _logged(caplog, f":{port}", "1009")
        attack.outcome("closed at the first frame over 64 KiB (1009), source named in the log")
        assert await _gossip_flows(honest, victim, 1)
        attack.effect("unaffected: the certified member's link and gossip carry on")


def _peak_resident_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status", encoding="ascii") as status:
        for line in status:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmHWM in /proc status")


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_large_frames_without_the_swarm_key_do_not_grow_the_victim(attack: Attack) -> None:
    """Send 6 x 60 MiB to a swarm-key node without knowing the key"""
    key = os.urandom(32).hex()
    victim = NodeProcess(
        *("--swarm-key-hex", key, "--gossip-period", "0.2", "--log-level", "INFO"),
        *("--request-timeout", str(scaled(30))),  # no handshake times out on a busy machine
    )
    honest = None
    try:
        honest = NodeProcess(
            "--swarm-key-hex", key, "--gossip-period", "0.2", "--initial-peer", victim.addresses[0]
        )
        assert wait_until(lambda: honest.peer_id in victim.members(), scaled(15))
        before = _peak_resident_bytes(victim.proc.pid)

        async def flood() -> list[tuple[int, int]]:
            hello = _hello(Identity().public_key, SwarmKeyAuth(bytes.fromhex(key)).mode)
            return await asyncio.gather(
                *(
                    _send_large_instead_of_auth(victim.addresses[0], hello, 60 << 20)
                    for _ in range(6)
                )
            )

        results = asyncio.run(flood())
        grown = _peak_resident_bytes(victim.proc.pid) - before
        assert all(code == 1009 for code, _ in results), results
        assert grown < 48 << 20, f"the victim's peak resident memory grew {grown >> 20} MiB"
        attack.outcome(
            f"each connection closed at its first frame (1009); victim's peak memory "
            f"+{grown >> 20} MiB for 360 MiB sent"
        )
        assert honest.store("honest", 7, 60)
        assert wait_until(lambda: (victim.get("honest") or {}).get("value") == 7, scaled(15)), (
            "the honest peer's record did not reach the victim"
        )
        attack.effect("unaffected: the honest peer's gossip reaches the victim")
    finally:
        if honest is not None:
            honest.quit()
        log = victim.quit()
    assert all(f":{port}" in log for _, port in results), log


async def test_idle_connections_from_one_source_leave_room_for_honest_peers(
    attack: Attack, caplog: pytest.LogCaptureFixture
) -> None:
    """Hold 64 idle WebSocket connections in their handshake to lock honest peers out"""
    # handshakes time out late here, so the idle connections outlast the honest dial
    victim = await _node(request_timeout=scaled(30))
    honest: AsyncNode | None = None
    idle: list[Any] = []
    try:
        with caplog.at_level(logging.WARNING, logger="peer.node"):
            for _ in range(64):  # one after another: each finishes its WebSocket opening
                idle.append(
                    await ws_connect(victim.visible_addresses[0], local_addr=(ATTACKER_HOST, 0))
                )
            limit = victim.config.max_pending_handshakes_per_source
            # refused ones are closed at once
            await wait_until_async(
                lambda: sum(c.state is WsState.OPEN for c in idle) <= limit, scaled(5)
            )
            waiting = sum(c.state is WsState.OPEN for c in idle)
            assert waiting <= limit, waiting
            assert any(
                r.getMessage().startswith(f"{ATTACKER_HOST} has {limit} connections")
                for r in caplog.records
            )
        attack.outcome(f"{waiting} of 64 kept waiting, the rest closed busy; source named")
        honest = await _node(victim.visible_addresses, request_timeout=scaled(30))
        assert await wait_until_async(lambda: honest.peer_id in victim.members(), scaled(10))
        assert await _gossip_flows(honest, victim, 2)
        attack.effect("unaffected: an honest peer joins and gossips meanwhile")
    finally:
        await asyncio.gather(*(c.close() for c in idle), return_exceptions=True)
        await asyncio.gather(
            *(n.shutdown() for n in (victim, honest) if n is not None), return_exceptions=True
        )


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
async def test_silent_connections_to_the_lane_port_hold_few_descriptors(
    attack: Attack, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Open 300 silent connections to a peer's bulk-lane port"""
    import peer.transport.bulk as bulk

    # the silent connections would otherwise be dropped at the preamble's timeout anyway
    monkeypatch.setattr(bulk, "ADMISSION_TIMEOUT", scaled(60))
    victim = await _node()
    honest = await _node(victim.visible_addresses)
    sockets: list[socket.socket] = []
    async with _nodes(victim, honest):
        assert victim.bulk is not None and victim.bulk.port is not None
        await victim.link(honest.peer_id)
        received: list[Frame] = []
        victim.register_handler("test.blob", Schema(payload=True), _collect(received))
        victim.accept_bulk("test.blob")
        base = _fds()
        loop = asyncio.get_running_loop()
        with caplog.at_level(logging.WARNING, logger="peer.transport.bulk"):
            for _ in range(300):
                sock = socket.socket()
                sock.setblocking(False)
                sock.bind((ATTACKER_HOST, 0))
                await loop.sock_connect(sock, ("127.0.0.1", victim.bulk.port))
                sockets.append(sock)
            await asyncio.sleep(0.5)  # the node accepts what the kernel queued

            def held_by_victim() -> int:
                return _fds() - base - len(sockets)

            await wait_until_async(
                lambda: held_by_victim() <= bulk.MAX_ADMISSIONS_PER_SOURCE, scaled(5)
            )
            held = held_by_victim()
            assert held <= bulk.MAX_ADMISSIONS_PER_SOURCE, held
            assert any(ATTACKER_HOST in r.getMessage() for r in caplog.records)
        attack.outcome(f"the victim holds {held} descriptors for 300 connections; source named")
        frame = Frame("test.blob", payload=bytes(1 << 20))
        await honest.send_bulk(victim.peer_id, frame)
        assert await wait_until_async(lambda: received, scaled(10))
        assert len(received[0].payload) == 1 << 20
        assert honest.bulk is not None and honest.bulk.has_lane(victim.peer_id)
        attack.effect("unaffected: an honest peer opens a lane and sends 1 MiB over it")
    for sock in sockets:
        sock.close()


def _collect(into: list[Frame]) -> Any:
    async def handler(sender: Any, frame: Frame) -> None:
        into.append(frame)

    return handler


async def test_no_construction_path_starts_an_open_node_beyond_loopback(attack: Attack) -> None:
    """Start a node with no authentication on 0.0.0.0 through AsyncNode or Node(transport=)"""
    from peer import Node
    from peer.formats.identity import OpenAuth

    config = NodeConfig(host="0.0.0.0")
    with pytest.raises(ValueError, match="no authentication"):
        AsyncNode(transport=WebSocketTransport(max_message_bytes=1 << 20), config=config)
    with pytest.raises(ValueError, match="no authentication"):
        Node(host="0.0.0.0", transport=WebSocketTransport(max_message_bytes=1 << 20))
    attack.outcome("refused with ValueError before anything listens, whichever way it is built")
    node = AsyncNode(
        transport=WebSocketTransport(max_message_bytes=1 << 20), auth=OpenAuth(), config=config
    )
    await node.start()
    try:
        assert node.visible_addresses
    finally:
        await node.shutdown()
    attack.effect("unaffected: asked for with auth=OpenAuth(), an open node starts")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
async def test_connections_that_never_open_hold_few_descriptors(
    attack: Attack, caplog: pytest.LogCaptureFixture
) -> None:
    """Open 300 TCP connections to a peer's WebSocket port that never send their upgrade"""
    import peer.transport.websocket as websocket

    victim = await _node()
    honest: AsyncNode | None = None
    sockets: list[socket.socket] = []
    port = int(victim.visible_addresses[0].rsplit(":", 1)[1])
    try:
        base = _fds()
        loop = asyncio.get_running_loop()
        with caplog.at_level(logging.WARNING, logger="peer.transport.websocket"):
            for _ in range(300):
                sock = socket.socket()
                sock.setblocking(False)
                sock.bind((ATTACKER_HOST, 0))
                await loop.sock_connect(sock, ("127.0.0.1", port))
                sockets.append(sock)

            def held_by_victim() -> int:
                return _fds() - base - len(sockets)

            await wait_until_async(
                lambda: (
                    held_by_victim() <= websocket.MAX_OPENING_PER_SOURCE
                    and any(ATTACKER_HOST in r.getMessage() for r in caplog.records)
                ),
                scaled(5),
            )
            held = held_by_victim()
            assert held <= websocket.MAX_OPENING_PER_SOURCE, held
            assert any(ATTACKER_HOST in r.getMessage() for r in caplog.records)
        attack.outcome(f"the victim holds {held} descriptors for 300 connections; source named")
        honest = await _node(victim.visible_addresses)
        assert await wait_until_async(lambda: honest.peer_id in victim.members(), scaled(10))
        assert await _gossip_flows(honest, victim, 3)
        attack.effect("unaffected: an honest peer joins and gossips meanwhile")
    finally:
        for sock in sockets:
            sock.close()
        await asyncio.gather(
            *(n.shutdown() for n in (victim, honest) if n is not None), return_exceptions=True
        )
