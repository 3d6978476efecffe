"""Nodes over real WebSockets on loopback: gossip, authentication, malformed input, shutdown."""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
import threading
import time
from collections.abc import Callable, Iterator, Sequence

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from websockets.exceptions import ConnectionClosed as WsClosed
from websockets.sync.client import connect as ws_connect

from peer import Node
from peer.exceptions import AuthenticationError, TransportError
from peer.formats.identity import (
    Certificate,
    CertificateAuth,
    CertificateVerifier,
    Identity,
    OpenAuth,
    SwarmKeyAuth,
)
from peer.node.exchange import GOSSIP_PUSH
from peer.node.gossip import Record
from peer.wire import Frame, encode_frame
from swarmlab.node_process import wait_until
from tests.conftest import scaled

FAST = {"gossip_period": 0.2, "request_timeout": 3.0}


@pytest.fixture
def swarm() -> Iterator[list[Node]]:
    nodes: list[Node] = []
    first = Node(**FAST)
    nodes.append(first)
    for _ in range(3):
        # a chain: each node knows only the previous one
        nodes.append(Node(nodes[-1].visible_addresses, **FAST))
    yield nodes
    for node in nodes:
        node.shutdown()


def test_record_reaches_everyone_then_is_replaced_then_expires(swarm: list[Node]) -> None:
    assert wait_until(lambda: all(len(n.members()) == 4 for n in swarm), scaled(10))
    t = swarm[0].get_time()
    assert swarm[0].store("greeting", {"hello": "swarm"}, t + 3)
    assert wait_until(
        lambda: all(n.get("greeting") == ({"hello": "swarm"}, t + 3) for n in swarm), scaled(10)
    )
    assert swarm[0].store("greeting", {"hello": "again"}, t + 4)
    assert wait_until(
        lambda: all(n.get("greeting") == ({"hello": "again"}, t + 4) for n in swarm), scaled(10)
    )
    assert not swarm[0].store("greeting", "stale", t + 2), (
        "an older expiration never replaces a newer one"
    )
    assert wait_until(lambda: all(n.get("greeting") is None for n in swarm), scaled(10))
    assert all(n.get("greeting") is None for n in swarm)


def test_subkeys_from_every_peer_merge(swarm: list[Node]) -> None:
    t = swarm[0].get_time() + 30
    for i, node in enumerate(swarm):
        node.store("progress", {"step": i}, t, subkey=node.peer_id)

    def merged() -> bool:
        return all(
            (v := n.get("progress")) is not None
            and {k: x.value["step"] for k, x in v.value.items()}
            == {m.peer_id: i for i, m in enumerate(swarm)}
            for n in swarm
        )

    assert wait_until(merged, scaled(10))


def test_get_latest_pulls_immediately() -> None:
    with (
        Node(gossip_period=60, member_ttl=180) as a,
        Node(a.visible_addresses, gossip_period=60, member_ttl=180) as b,
    ):
        a.store("k", 1, a.get_time() + 30)
        # With a 60 s period nothing arrives by itself soon; latest=True pulls right away.
        assert b.get("k", latest=True) == (1, pytest.approx(a.get_time() + 30, abs=5))


def test_a_watch_fires_when_a_peer_stores_under_its_key(caplog: pytest.LogCaptureFixture) -> None:
    """``AsyncNode.watch``: a record arriving under the key calls back at once (here with no
    gossip round for 60 s: the store's push), other keys do not, a failing callback is
    logged without stopping the others, and a stopped watch stays quiet."""
    with (
        Node(gossip_period=60, member_ttl=180) as a,
        Node(a.visible_addresses, gossip_period=60, member_ttl=180) as b,
    ):
        assert wait_until(lambda: len(a.members()) == 2 and len(b.members()) == 2, scaled(10))
        calls: list[int] = []
        fired = threading.Event()

        def seen() -> None:
            calls.append(1)
            fired.set()

        def broken() -> None:
            raise RuntimeError("watcher bug")

        async def start() -> Callable[[], None]:
            b.core.watch("k", broken)
            return b.core.watch("k", seen)

        stop = b.run_coroutine(start())
        with caplog.at_level(logging.ERROR, logger="peer.node.core"):
            a.store("other", 1, a.get_time() + 30)
            a.store("k", 1, a.get_time() + 30)
            assert fired.wait(scaled(10))
            assert wait_until(lambda: b.get("other") is not None, scaled(10))
        assert calls == [1] and "watcher bug" in caplog.text

        async def unwatch() -> None:
            stop()

        b.run_coroutine(unwatch())
        a.store("k", 2, a.get_time() + 31)
        assert wait_until(lambda: (v := b.get("k")) is not None and v[0] == 2, scaled(10))
        assert calls == [1]


def test_a_stored_record_is_relayed_to_peers_its_writer_did_not_push_to() -> None:
    """A store is pushed at once to ``fanout`` peers, which relay what was news to them
    (``push_relays`` times, never back to the sender): with a fanout of 1 and no gossip
    round for 60 s, both other peers still get it at once."""
    slow = {"gossip_period": 60, "member_ttl": 180, "fanout": 1}
    with (
        Node(**slow) as a,
        Node(a.visible_addresses, **slow) as b,
        Node(a.visible_addresses, **slow) as c,
    ):
        assert wait_until(lambda: len(a.members()) == 3 and len(c.members()) == 3, scaled(10))
        b.get("anything", latest=True)  # b pulls from a, the only peer it knows: learns c
        assert len(b.members()) == 3
        b.run_coroutine(b.core.link(c.peer_id))  # links between all, as in a busy swarm
        watched = {n.peer_id: threading.Event() for n in (b, c)}

        async def watch(node: Node) -> None:
            node.core.watch("k", watched[node.peer_id].set)

        for node in (b, c):
            node.run_coroutine(watch(node))
        a.store("k", 1, a.get_time() + 30)
        assert all(event.wait(scaled(5)) for event in watched.values())
        assert b.get("k") is not None and c.get("k") is not None


def test_client_mode_node_participates_by_dialing_out() -> None:
    with Node(**FAST) as server, Node(server.visible_addresses, client_mode=True, **FAST) as client:
        assert client.visible_addresses == []
        client.store("from-client", 1, client.get_time() + 30)
        server.store("from-server", 2, server.get_time() + 30)
        assert wait_until(
            lambda: server.get("from-client") is not None and client.get("from-server") is not None,
            scaled(10),
        )
        assert server.members()[client.peer_id].client_mode


def test_store_validates_arguments() -> None:
    with Node(**FAST) as node:
        with pytest.raises(ValueError, match="reserved"):
            node.store("_members", 1, node.get_time() + 10)
        with pytest.raises(TypeError, match="msgpack"):
            node.store("k", object(), node.get_time() + 10)
        with pytest.raises(TypeError, match="subkey"):
            node.store("k", 1, node.get_time() + 10, subkey=1.5)
        assert not node.store("k", 1, node.get_time() - 1), "already expired"
    with pytest.raises(TypeError, match="list of addresses"):
        Node("ws://127.0.0.1:1")


def test_forged_record_relayed_by_a_peer_is_rejected(caplog: pytest.LogCaptureFixture) -> None:
    with (
        Node(**FAST) as victim,
        Node(**FAST) as mallory,
        Node(victim.visible_addresses, **FAST) as honest,
    ):
        honest.store("balance", 10, honest.get_time() + 30)
        assert wait_until(lambda: victim.get("balance") is not None, scaled(10))
        genuine = next(r for r in victim.core.store_.records("balance", victim.get_time()))
        forged = Record(
            genuine.key,
            genuine.subkey,
            Record.create(mallory.identity, "x", None, 10**6, 1, seq=1).value,
            genuine.expiration + 100,
            genuine.seq,
            genuine.owner,
            genuine.signature,
        )

        async def relay() -> bool:
            link = await mallory.core.link(victim.peer_id, victim.visible_addresses)
            await link.send(Frame(GOSSIP_PUSH, {"records": [forged.to_wire()]}))
            await asyncio.wait_for(link._reader, scaled(5))  # the victim drops the link
            return link.closed

        with caplog.at_level(logging.WARNING, logger="peer"):
            assert mallory.run_coroutine(relay())
        assert victim.get("balance") == (10, genuine.expiration)
        assert any("invalid signature" in r.getMessage() for r in caplog.records)
        # The victim keeps serving honest peers.
        honest.store("after", 1, honest.get_time() + 30)
        assert wait_until(lambda: victim.get("after") is not None, scaled(10))


def test_wrong_swarm_key_is_refused_at_the_handshake() -> None:
    key = secrets.token_bytes(32)
    with Node(auth=SwarmKeyAuth(key), **FAST) as a:
        with Node(a.visible_addresses, auth=SwarmKeyAuth(key), **FAST) as b:
            assert wait_until(lambda: b.peer_id in a.members(), scaled(10))
        with Node(auth=SwarmKeyAuth(secrets.token_bytes(32)), **FAST) as intruder:
            with pytest.raises(TransportError, match="wrong swarm key"):
                intruder.run_coroutine(intruder.core.link(a.peer_id, a.visible_addresses))
            assert intruder.peer_id not in a.members()
        with Node(**FAST) as open_node:  # open mode never falls back into a keyed swarm
            with pytest.raises(TransportError, match="mode mismatch"):
                open_node.run_coroutine(open_node.core.link(a.peer_id, a.visible_addresses))


def test_certificates_are_required_and_checked() -> None:
    authority, other_authority = Identity(), Identity()

    def credentials(
        run_id: str, signer: Identity, expires_in: float = 60
    ) -> tuple[Identity, CertificateAuth]:
        ident = Identity()
        cert = Certificate.issue(
            signer, run_id=run_id, public_key=ident.public_key, expires_at=time.time() + expires_in
        )
        return ident, CertificateAuth(
            cert.to_bytes(), CertificateVerifier(authority.public_key, "run")
        )

    ident_a, auth_a = credentials("run", authority)
    ident_b, auth_b = credentials("run", authority)
    with (
        Node(identity=ident_a, auth=auth_a, **FAST) as a,
        Node(a.visible_addresses, identity=ident_b, auth=auth_b, **FAST) as b,
    ):
        assert wait_until(lambda: b.peer_id in a.members() and a.peer_id in b.members(), scaled(10))
        for ident, auth, reason in (
            (*credentials("other-run", authority), "is for run 'other-run'"),
            (*credentials("run", other_authority), "not signed by this run"),
            (*credentials("run", authority, expires_in=-60), "expired"),
        ):
            with Node(identity=ident, auth=auth, **FAST) as intruder:
                with pytest.raises(TransportError, match=reason):
                    intruder.run_coroutine(intruder.core.link(a.peer_id, a.visible_addresses))
        # A certificate issued to someone else's key is useless without that key.
        thief = Identity()
        with Node(
            identity=thief, auth=CertificateAuth(auth_b.certificate, auth_b.verify), **FAST
        ) as intruder:
            with pytest.raises(TransportError, match="different public key"):
                intruder.run_coroutine(intruder.core.link(a.peer_id, a.visible_addresses))
        assert set(a.members()) == {a.peer_id, b.peer_id}


def test_unauthenticated_frames_before_the_handshake_are_refused() -> None:
    with Node(**FAST) as node:
        record = Record.create(Identity(), "sneaky", None, 1, node.get_time() + 30, seq=1)
        with ws_connect(node.visible_addresses[0]) as ws:
            ws.recv(timeout=scaled(5))  # the node's hello
            ws.send(encode_frame(Frame(GOSSIP_PUSH, {"records": [record.to_wire()]})))
            with pytest.raises(WsClosed) as info:
                while True:
                    ws.recv(timeout=scaled(5))
            assert "expected 'hello' first" in info.value.rcvd.reason
        assert node.get("sneaky") is None


@pytest.fixture(scope="module")
def target() -> Iterator[Node]:
    with Node(**FAST) as node:
        yield node


def _probe(node: Node, data: bytes) -> str:
    with ws_connect(node.visible_addresses[0], max_size=None) as ws:
        ws.recv(timeout=scaled(5))
        try:
            ws.send(data)
            while True:
                ws.recv(timeout=scaled(5))
        except WsClosed as exc:
            return exc.rcvd.reason if exc.rcvd else "lost"
    return "open"


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    st.one_of(
        st.binary(max_size=300),
        st.binary(min_size=4, max_size=40).map(
            lambda b: b"\x00\x00\x00\x20" + b
        ),  # truncated headers
        st.sampled_from(
            [b"\x00\x00\x00\x03\xc1\xc1\xc1", b"\x00\x00\x00\x01\x90"]
        ),  # bad msgpack, not a map
    )
)
def test_malformed_input_closes_only_that_connection(target: Node, data: bytes) -> None:
    reason = _probe(target, data)
    assert reason not in ("open", "lost") and len(reason) > 5
    # The node keeps serving everyone else.
    with Node(target.visible_addresses, **FAST) as other:
        assert other.get("anything", latest=True) is None
        assert target.peer_id in other.members()


def test_wrong_version_unknown_type_and_oversized_frames(target: Node) -> None:
    import msgpack

    def raw(header: dict) -> bytes:
        packed = msgpack.packb(header)
        return len(packed).to_bytes(4, "big") + packed

    assert "version 7" in _probe(target, raw({"t": "hello", "v": 7, "n": 0, "f": {}}))
    assert "unknown message type" in _probe(target, raw({"t": "teleport", "v": 1, "n": 0, "f": {}}))
    # A message over the frame limit is refused by the WebSocket layer (close code 1009).
    with ws_connect(target.visible_addresses[0], max_size=None) as ws:
        ws.recv(timeout=scaled(5))
        ws.send(b"\x00" * (target.config.limits.max_frame_bytes + 1))
        with pytest.raises(WsClosed) as info:
            ws.recv(timeout=scaled(10))
        assert info.value.rcvd is not None and info.value.rcvd.code == 1009
    with Node(target.visible_addresses, **FAST) as other:
        assert target.peer_id in other.members()


def test_malformed_frames_after_the_handshake_close_the_link(target: Node) -> None:
    with Node(**FAST) as peer:

        async def send_garbage() -> str:
            link = await peer.core.link(target.peer_id, target.visible_addresses)
            await link.conn.send(b"\x00\x00\x00\x02\xc1\xc1")
            await asyncio.wait_for(link._reader, scaled(5))
            return link.conn.close_reason

        assert "not valid msgpack" in peer.run_coroutine(send_garbage())
        with Node(target.visible_addresses, **FAST) as other:
            assert target.peer_id in other.members()


def _open_fds() -> set[str]:
    return {
        os.readlink(f"/proc/self/fd/{fd}")
        for fd in os.listdir("/proc/self/fd")
        if os.path.exists(f"/proc/self/fd/{fd}")
    }


def _shut_down_leaving_nothing(
    nodes: Sequence[Node], threads_before: set[threading.Thread], sockets_before: set[str]
) -> None:
    """Shut ``nodes`` down in order, checking that each core stops every task it started,
    and that no thread or socket outlives them."""

    async def leftover_tasks() -> list[asyncio.Task]:
        return [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]

    for node in nodes:
        node.run_coroutine(node.core.shutdown())
        assert node.run_coroutine(leftover_tasks()) == [], (
            "core.shutdown() must stop every task it started"
        )
        node.shutdown()
    assert set(threading.enumerate()) == threads_before
    assert {fd for fd in _open_fds() if fd.startswith("socket:")} <= sockets_before


def test_shutdown_leaves_no_task_thread_or_socket() -> None:
    threads_before = set(threading.enumerate())
    sockets_before = {fd for fd in _open_fds() if fd.startswith("socket:")}
    a = Node(**FAST)
    b = Node(a.visible_addresses, **FAST)
    c = Node(b.visible_addresses, client_mode=True, **FAST)
    assert wait_until(lambda: len(a.members()) == 3, scaled(10))
    assert {fd for fd in _open_fds() if fd.startswith("socket:")} - sockets_before, (
        "nodes hold sockets while running"
    )

    _shut_down_leaving_nothing((c, b, a), threads_before, sockets_before)
    with pytest.raises(Exception, match="shut down"):
        a.get("k")


def test_unreachable_initial_peer_is_reported_not_fatal(caplog: pytest.LogCaptureFixture) -> None:
    with (
        caplog.at_level(logging.WARNING, logger="peer"),
        Node(["ws://127.0.0.1:9"], **FAST) as lonely,
    ):
        assert lonely.get("x") is None
    assert any("could not reach any initial peer" in r.getMessage() for r in caplog.records)


def test_linking_to_an_unknown_peer_fails_clearly() -> None:
    with Node(**FAST) as node:
        with pytest.raises(TransportError, match="not reachable"):
            node.run_coroutine(node.core.link("nobody"))
        with pytest.raises(TransportError):
            node.run_coroutine(node.core.link("nobody", ["ws://127.0.0.1:9"]))
    assert AuthenticationError  # re-exported type stays importable


def test_oversized_frames_are_refused_before_sending() -> None:
    from peer.exceptions import FrameTooLarge
    from peer.wire import Limits

    small = Limits(max_header_bytes=4096, max_payload_bytes=1024)
    with Node(limits=small, **FAST) as a, Node(a.visible_addresses, limits=small, **FAST) as b:

        async def send(frame: Frame) -> None:
            link = await b.core.link(a.peer_id, a.visible_addresses)
            await link.send(frame)

        with pytest.raises(FrameTooLarge, match="payload over the limit"):
            b.run_coroutine(send(Frame(GOSSIP_PUSH, {"records": []}, b"x" * 2048)))
        with pytest.raises(FrameTooLarge, match="header over the limit"):
            b.run_coroutine(send(Frame(GOSSIP_PUSH, {"records": ["y" * 5000]})))
        # Nothing was sent, so the link is still healthy.
        b.store("still-fine", 1, b.get_time() + 30)
        assert wait_until(lambda: a.get("still-fine") is not None, scaled(10))


# --------------------------------------------------------------------------- run-time changes


def test_set_auth_presents_a_renewed_certificate_in_later_handshakes(
    caplog: pytest.LogCaptureFixture,
) -> None:
    authority = Identity()
    verifier = CertificateVerifier(authority.public_key, "run")

    def auth_for(ident: Identity, expires_in: float) -> CertificateAuth:
        cert = Certificate.issue(
            authority,
            run_id="run",
            public_key=ident.public_key,
            expires_at=time.time() + expires_in,
        )
        return CertificateAuth(cert.to_bytes(), verifier)

    ident_a, ident_b = Identity(), Identity()
    with (
        caplog.at_level(logging.WARNING, logger="peer"),
        Node(identity=ident_a, auth=auth_for(ident_a, 60), **FAST) as a,
        Node(a.visible_addresses, identity=ident_b, auth=auth_for(ident_b, -60), **FAST) as b,
    ):
        # b's certificate has expired: a refuses it at every gossip round's retry
        assert wait_until(lambda: caplog.text.count("certificate has expired") >= 2, scaled(10))
        assert b.peer_id not in a.members()
        b.set_auth(auth_for(ident_b, 60))  # renewed: the next retry gets in
        assert wait_until(lambda: b.peer_id in a.members() and a.peer_id in b.members(), scaled(10))
        with pytest.raises(ValueError, match="cannot switch to 'open'"):
            b.set_auth(OpenAuth())
    not_started = Node(start=False, **FAST)
    with pytest.raises(ValueError, match="cannot switch"):
        not_started.set_auth(SwarmKeyAuth(secrets.token_bytes(32)))


def test_a_link_closes_when_the_peers_certificate_expires_unless_renewed_over_it(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """b's and c's certificates last 3 s. c renews over its open link before that and stays
    linked to a; b does not, and a closes its link when b's certificate expires (naming b),
    and refuses b's redial."""
    authority = Identity()
    verifier = CertificateVerifier(authority.public_key, "run", max_clock_skew=0.0)

    def auth_for(ident: Identity, expires_in: float) -> CertificateAuth:
        cert = Certificate.issue(
            authority,
            run_id="run",
            public_key=ident.public_key,
            expires_at=time.time() + expires_in,
        )
        return CertificateAuth(cert.to_bytes(), verifier)

    ident_a, ident_b, ident_c = Identity(), Identity(), Identity()
    with (
        caplog.at_level(logging.WARNING, logger="peer.node"),
        Node(identity=ident_a, auth=auth_for(ident_a, 600), **FAST) as a,
        Node(a.visible_addresses, identity=ident_b, auth=auth_for(ident_b, 3), **FAST) as b,
        Node(a.visible_addresses, identity=ident_c, auth=auth_for(ident_c, 3), **FAST) as c,
    ):
        linked = lambda n: n.peer_id in a.core.pool.by_peer  # noqa: E731
        assert wait_until(lambda: linked(b) and linked(c), scaled(10))
        c.set_auth(auth_for(ident_c, 600))
        expired = f"closing the link to {b.peer_id}: its certificate expired"
        assert wait_until(lambda: expired in caplog.text, scaled(15))
        assert wait_until(lambda: not linked(b), scaled(5))
        assert linked(c), "a renewed certificate keeps the link"
        assert f"closing the link to {c.peer_id}" not in caplog.text
        assert wait_until(lambda: "certificate has expired" in caplog.text, scaled(10))
        assert not linked(b), "b's redials are refused"


def test_a_node_that_lost_every_link_reconnects_to_addresses_it_is_handed() -> None:
    with Node(**FAST) as a:
        b = Node(a.visible_addresses, **FAST)
        try:
            assert wait_until(lambda: a.num_links == 1 and b.peer_id in a.members(), scaled(10))
        finally:
            b.shutdown()
        assert wait_until(lambda: a.num_links == 0 and len(a.members()) == 1, scaled(10))
        with Node(**FAST) as c:  # a newcomer that knows nobody
            assert a.add_initial_peers(c.visible_addresses) == 1
            assert a.num_links == 1
            assert wait_until(
                lambda: a.peer_id in c.members() and c.peer_id in a.members(), scaled(10)
            )
            assert a.core.gossip.initial_peers == c.visible_addresses  # kept for later
            assert a.add_initial_peers(["ws://127.0.0.1:9"]) == 0  # replaces the earlier ones
            assert a.core.gossip.initial_peers == ["ws://127.0.0.1:9"]
        with pytest.raises(TypeError, match="list"):
            a.add_initial_peers("ws://127.0.0.1:9")


def test_announce_changes_the_address_other_members_see() -> None:
    with Node(**FAST) as a, Node(a.visible_addresses, **FAST) as b:
        assert wait_until(lambda: a.peer_id in b.members(), scaled(10))
        port = a.visible_addresses[0].rsplit(":", 1)[1]
        announced = f"ws://localhost:{port}"  # another way to the same listener
        a.announce([announced])
        assert a.visible_addresses == [announced]
        assert wait_until(lambda: b.members()[a.peer_id].addresses == (announced,), scaled(10))
        # a newcomer learns the new address from b, and it works
        with Node(b.visible_addresses, **FAST) as c:
            assert wait_until(lambda: a.peer_id in c.members(), scaled(10))
            assert c.members()[a.peer_id].addresses == (announced,)
            c.run_coroutine(c.core.link(a.peer_id))
        with pytest.raises(ValueError, match="at most 16"):
            a.announce([announced] * 17)
    with Node(client_mode=True, **FAST) as client, pytest.raises(ValueError, match="client-mode"):
        client.announce(["ws://127.0.0.1:1"])


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "192.0.2.7", "peer.example"])
def test_an_open_node_off_loopback_must_be_asked_for(host: str) -> None:
    """Without auth a node is open: it refuses to listen beyond loopback unless told
    auth=OpenAuth() (nothing is bound when it refuses)."""
    with pytest.raises(ValueError, match="no authentication"):
        Node(host=host, port=0)


def test_open_nodes_on_loopback_or_asked_for_or_dialing_out_start() -> None:
    for kwargs in (
        {"host": "127.0.0.1"},
        {"host": "::1"},
        {"host": "localhost"},
        {"host": "0.0.0.0", "auth": OpenAuth()},
        {"host": "0.0.0.0", "client_mode": True},
    ):
        with Node(**kwargs) as node:  # type: ignore[arg-type]
            assert node.visible_addresses or kwargs.get("client_mode")


def test_sources_are_ip_addresses_or_ipv6_networks() -> None:
    """Limits per source count an IPv4 address (mapped into IPv6 or not) as one source and
    an IPv6 /56 as one: a subscriber commonly gets a whole /56, not one address or /64."""
    from peer.transport.base import source_of

    assert source_of("ws://198.51.100.7:50312") == "198.51.100.7"
    assert source_of("ws://[::ffff:198.51.100.7]:1") == "198.51.100.7"
    assert source_of("198.51.100.7") == "198.51.100.7"
    assert source_of("ws://[2001:db8:1:2:aaaa::1]:9") == "2001:db8:1::/56"
    assert source_of("ws://[2001:db8:1:2:bbbb::9]:9") == source_of("2001:db8:1:2::5")
    assert source_of("ws://[2001:db8:1:3::1]:9") == source_of("2001:db8:1:2::1")
    assert source_of("ws://[2001:db8:1:100::1]:9") != source_of("2001:db8:1:2::1")
    assert source_of("mem://alice") == "alice"
