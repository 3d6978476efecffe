"""Attacks by a relay on what it carries: two peers reachable only through it gossip and
average over links sealed end to end, so the relay reads no plaintext, and a byte it alters
fails authentication at the peer, which drops the link and dials again."""

from __future__ import annotations

import logging
import time

import pytest

from peer.transport.relay_protocol import Circuit, Party
from peer.transport.relay_server import RelayServer
from swarmlab.node_process import wait_until
from tests.attacks.conftest import Attack
from tests.conftest import scaled
from tests.peer.relay_helpers import Authority, relayed_node, running_relay

SECRET = "the-plaintext-a-relay-must-never-see"


class RecordingRelay(RelayServer):
    """Keeps every byte it carries."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.seen = bytearray()

    def carry(self, circuit: Circuit, sender: Party, data: bytes) -> bytes:
        self.seen += data
        return data


class TamperingRelay(RelayServer):
    """Flips one bit of a message's last byte on the first circuit, once the link's
    handshake is through (past its first few KiB)."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.carried = 0
        self.flipped = 0

    def carry(self, circuit: Circuit, sender: Party, data: bytes) -> bytes:
        self.carried += len(data)
        if not self.flipped and self.carried > 8192 and len(data) >= 64:
            self.flipped += 1
            return data[:-1] + bytes([data[-1] ^ 0x01])
        return data


def test_a_relay_reads_nothing_of_what_it_carries(attack: Attack) -> None:
    """A relay cannot read what it carries"""
    authority = Authority()
    with running_relay(authority, server_class=RecordingRelay) as relay:
        a = relayed_node(authority, relay)
        b = relayed_node(authority, relay, a.visible_addresses)
        try:
            a.store("secret", SECRET, time.time() + 60)
            assert wait_until(lambda: b.get("secret") is not None, scaled(15))
            assert b.get("secret").value == SECRET
            assert isinstance(relay, RecordingRelay) and len(relay.seen) > 1000
            assert SECRET.encode() not in relay.seen
            assert b"secret" not in relay.seen
            attack.outcome(f"the relay saw {len(relay.seen)} bytes and no plaintext in them")
            attack.effect("the record reached the other peer through the relay, intact")
        finally:
            b.shutdown()
            a.shutdown()


def test_a_relay_cannot_alter_what_it_carries(
    attack: Attack, caplog: pytest.LogCaptureFixture
) -> None:
    """A relay cannot alter what it carries"""
    caplog.set_level(logging.WARNING, logger="peer.node")
    authority = Authority()
    with running_relay(authority, server_class=TamperingRelay) as relay:
        assert isinstance(relay, TamperingRelay)
        a = relayed_node(authority, relay)
        b = relayed_node(authority, relay, a.visible_addresses)
        try:
            assert wait_until(lambda: a.peer_id in b.members(), scaled(15))
            for i in range(200):  # traffic until the relay has flipped its bit
                a.store("value", f"honest-{i}", time.time() + 60)
                if wait_until(lambda: relay.flipped > 0, 0.05):
                    break
            assert relay.flipped == 1
            assert wait_until(
                lambda: any("failed authentication" in r.getMessage() for r in caplog.records),
                scaled(10),
            ), [r.getMessage() for r in caplog.records]
            attack.outcome("the altered message failed authentication; the link was dropped")
            # the peers dial again and go on with honest values only
            a.store("after", "intact", time.time() + 60)
            assert wait_until(lambda: b.get("after") is not None, scaled(15))
            assert b.get("after").value == "intact"
            assert str(b.get("value").value).startswith("honest-")
            attack.effect("the peers linked again and the values they hold are the honest ones")
        finally:
            b.shutdown()
            a.shutdown()
