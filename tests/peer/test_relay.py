"""Relays on loopback: peers reachable only through a relay gossip and average through it;
the relay admits only authenticated peers of its runs, splices only to registered peers,
and refuses a peer past its limits with the reason."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from typing import Any

import pytest
import torch

from peer import DecentralizedAverager
from peer.exceptions import RelayRefused, TransportError
from peer.formats.identity import Identity
from peer.node.node import LoopThread
from peer.transport.relay import (
    is_relayed,
    open_relay_connection,
    parse_relay_address,
    relay_address,
)
from peer.transport.relay_protocol import ACCEPT, DIAL, INCOMING, LISTEN, RelayLimits
from swarmlab.node_process import wait_until
from tests.conftest import scaled
from tests.peer.relay_helpers import Authority, relayed_node, running_relay


def test_two_peers_reachable_only_through_a_relay_average_through_it() -> None:
    authority = Authority()
    with running_relay(authority) as relay:
        a = relayed_node(authority, relay)
        b = relayed_node(authority, relay, a.visible_addresses)
        try:
            assert all(is_relayed(x) for x in a.visible_addresses + b.visible_addresses)
            assert wait_until(
                lambda: a.peer_id in b.members() and b.peer_id in a.members(), scaled(15)
            )
            link = b.core.pool.by_peer[a.peer_id]
            assert link.conn.remote_address == a.visible_addresses[0]
            tensors = [[torch.arange(50_000, dtype=torch.float32) * i] for i in (1, 3)]
            averagers = [
                DecentralizedAverager(
                    t, node, prefix="relayed", min_matchmaking_time=1.0, start=True
                )
                for t, node in zip(tensors, (a, b), strict=True)
            ]
            try:
                controls = [av.step(wait=False, timeout=scaled(30)) for av in averagers]
                results = [c.result(timeout=scaled(60)) for c in controls]
                assert all(set(r) == {a.peer_id, b.peer_id} for r in results), results
                expected = torch.arange(50_000, dtype=torch.float32) * 2
                for t in tensors:
                    assert torch.allclose(t[0], expected)
            finally:
                for av in averagers:
                    av.shutdown()
            stats = relay.stats()
            # the tensors (200 KB each way at least) went through the relay, in circuits
            assert stats["bytes_carried"] > 2 * 200_000, stats
            assert stats["peers"] == 2 and stats["circuits_opened"] >= 1, stats
        finally:
            b.shutdown()
            a.shutdown()


def test_a_relayed_link_sends_its_bulk_frames_over_the_link() -> None:
    """Lanes do not run over relays: the sender falls back to the link at once, and the
    frames arrive (through the relay)."""
    authority = Authority()
    with running_relay(authority) as relay:
        a = relayed_node(authority, relay)
        b = relayed_node(authority, relay, a.visible_addresses)
        try:
            assert wait_until(lambda: a.peer_id in b.members(), scaled(15))
            bulk = b.core.bulk
            assert bulk is not None
            lane = b.run_coroutine(bulk._lane(a.peer_id))
            assert lane is None and not bulk.has_lane(a.peer_id)
        finally:
            b.shutdown()
            a.shutdown()


def _dial(relay_url: str, authority: Authority, target: str, **credentials: object) -> None:
    """Dial ``target`` through the relay as a fresh peer of ``authority``'s run."""
    ident, auth = authority.credentials(**credentials)  # type: ignore[arg-type]
    thread = LoopThread("dialer")

    async def dial() -> None:
        sock, _ = await open_relay_connection(
            parse_relay_address(relay_url),
            identity=ident,
            certificate=auth.certificate,
            kind=DIAL,
            arg=target.encode(),
            timeout=scaled(5),
        )
        sock.close()

    try:
        thread.submit(dial()).result()
    finally:
        thread.stop()


def test_only_authenticated_peers_of_a_served_run_may_use_the_relay() -> None:
    authority = Authority()
    with running_relay(authority) as relay:
        a = relayed_node(authority, relay)
        try:
            for stranger, match in (
                (Authority(), "not signed by this run's authority"),
                (Authority(run_id="another-run"), "does not serve run 'another-run'"),
            ):
                with pytest.raises(RelayRefused, match=match):
                    _dial(relay.address, stranger, a.peer_id)
            with pytest.raises(RelayRefused, match="expired"):
                _dial(relay.address, authority, a.peer_id, expires_in=-60)
            with pytest.raises(RelayRefused, match="is not registered with this relay"):
                _dial(relay.address, authority, "z" * 32)
            _dial(relay.address, authority, a.peer_id)  # an honest dial is carried
            assert relay.stats()["refusals"] == 4
        finally:
            a.shutdown()


def test_a_peer_past_its_circuit_limit_is_refused_with_the_reason() -> None:
    authority = Authority()
    with running_relay(authority, RelayLimits(max_circuits_per_peer=1)) as relay:
        a = relayed_node(authority, relay)
        b = relayed_node(authority, relay, a.visible_addresses)
        c_ident, c_auth = authority.credentials()
        from peer import Node

        c = Node(identity=c_ident, auth=c_auth, gossip_period=0.2)
        try:
            assert wait_until(lambda: b.peer_id in a.members(), scaled(15))
            with pytest.raises(TransportError, match="holds its limit of 1 circuits"):
                c.run_coroutine(c.core.link(a.peer_id, a.visible_addresses))
        finally:
            for node in (c, b, a):
                node.shutdown()


def test_a_peer_past_its_byte_cap_loses_its_circuit_and_is_refused_new_ones(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="peer.transport.relay")
    authority = Authority()
    limits = RelayLimits(byte_cap=64 << 10, cap_window=3600)
    with running_relay(authority, limits) as relay:
        relay_at = parse_relay_address(relay.address)
        sink_ident, sink_auth = authority.credentials()
        ident, auth = authority.credentials(volunteer="greedy")
        thread = LoopThread("greedy")

        async def connect(identity: Identity, certificate: bytes, kind: str, arg: bytes) -> Any:
            return await open_relay_connection(
                relay_at,
                identity=identity,
                certificate=certificate,
                kind=kind,
                arg=arg,
                timeout=scaled(5),
            )

        async def sink() -> None:
            """A registered peer that takes every circuit and reads it to the end."""
            loop = asyncio.get_running_loop()
            control, greeting = await connect(sink_ident, sink_auth.certificate, LISTEN, b"")
            accepted: list[socket.socket] = []
            draining: list[asyncio.Task[None]] = []
            try:
                while True:
                    message_type, fields = await greeting.read()
                    if message_type == INCOMING:
                        sock, _ = await connect(
                            sink_ident, sink_auth.certificate, ACCEPT, fields["ticket"]
                        )
                        accepted.append(sock)
                        draining.append(loop.create_task(drain(sock)))
            finally:
                control.close()
                for sock in accepted:
                    sock.close()
                for task in draining:
                    task.cancel()

        async def drain(sock: socket.socket) -> None:
            loop = asyncio.get_running_loop()
            with contextlib.suppress(OSError):
                while await loop.sock_recv(sock, 1 << 16):
                    pass

        async def flood() -> str:
            loop = asyncio.get_running_loop()
            sock, _ = await connect(ident, auth.certificate, DIAL, sink_ident.peer_id.encode())
            try:
                with contextlib.suppress(OSError):  # until the relay closes the circuit
                    for _ in range(1000):
                        await loop.sock_sendall(sock, b"x" * 4096)
            finally:
                sock.close()
            try:
                await connect(ident, auth.certificate, DIAL, sink_ident.peer_id.encode())
            except RelayRefused as exc:
                return str(exc)
            return "carried"

        sinking = thread.submit(sink())
        try:
            assert wait_until(lambda: relay.stats()["peers"] == 1, scaled(5))
            reason = thread.submit(flood()).result(timeout=scaled(30))
            assert "account greedy sent its cap of 65536 bytes" in reason, reason
            # carried up to its cap exactly, whatever chunks the relay read its bytes in
            assert relay.stats()["bytes_carried"] == 64 << 10
            assert any("sent its cap" in r.getMessage() for r in caplog.records)
        finally:
            sinking.cancel()
            thread.stop()


def test_a_relay_address_names_a_peer() -> None:
    authority = Authority()
    with running_relay(authority) as relay:
        a = relayed_node(authority, relay)
        try:
            with pytest.raises(TransportError, match="names a relay, not a peer"):
                a.run_coroutine(a.core.transport.connect(relay.address, timeout=scaled(5)))
            assert a.visible_addresses == [relay_address(relay.address, a.peer_id)]
        finally:
            a.shutdown()
