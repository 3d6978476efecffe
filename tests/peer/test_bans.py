"""Bans in the swarm: the run authority's signed revocation list, checked without I/O, then
spread among real nodes in certificate mode (virtual time)."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import msgpack
import pytest

from peer.exceptions import AuthenticationError, SwarmgradError
from peer.formats.identity import Identity
from peer.formats.revocation import RevocationBook, RevocationList
from peer.node.trust import LINK_REVOCATIONS
from peer.transport.memory import MemoryNetwork
from peer.wire import Frame
from swarmlab.node_process import wait_until_async
from swarmlab.sim import VirtualTimeLoop
from tests.peer.test_attacks_gossip import _certified, vloop  # noqa: F401

RUN = "run"


def _list(authority: Identity, serial: int, *keys: bytes, until: float = 2e9) -> bytes:
    entries = [(key, until) for key in keys]
    return RevocationList.issue(authority, run_id=RUN, serial=serial, entries=entries).to_bytes()


# ------------------------------------------------------------------------------ the list


def test_a_list_round_trips_and_bans_its_keys_until_their_time() -> None:
    authority, banned, other = Identity(), Identity(), Identity()
    book = RevocationBook(authority.public_key, RUN)
    accepted = book.offer(_list(authority, 3, banned.public_key, until=1000.0))
    assert accepted is not None and accepted.serial == 3
    assert book.revoked(banned.public_key, 999.0)
    assert not book.revoked(banned.public_key, 1000.5), "its certificates are dead by then"
    assert not book.revoked(other.public_key, 999.0)
    assert book.revoked_keys(999.0) == [banned.public_key]
    assert RevocationList.from_base64(accepted.to_base64()) == accepted


def test_an_older_or_known_list_changes_nothing() -> None:
    """A relay cannot lift a ban by sending an older list again."""
    authority, first, second = Identity(), Identity(), Identity()
    book = RevocationBook(authority.public_key, RUN)
    newer = _list(authority, 2, first.public_key, second.public_key)
    assert book.offer(newer) is not None
    assert book.offer(newer) is None
    assert book.offer(_list(authority, 1, first.public_key)) is None
    assert book.serial == 2 and book.revoked(second.public_key, 0.0)


@pytest.mark.parametrize(
    "forge",
    [
        lambda authority, key: RevocationList.issue(
            Identity(), run_id=RUN, serial=9, entries=[(key, 2e9)]
        ).to_bytes(),
        lambda authority, key: RevocationList.issue(
            authority, run_id="another-run", serial=9, entries=[(key, 2e9)]
        ).to_bytes(),
        # a genuine signature over one list, with a key added after signing
        lambda authority, key: msgpack.packb(
            [RUN, 9, [[key, 2e9], [Identity().public_key, 2e9]], authority.sign(b"x")],
            use_bin_type=True,
        ),
        lambda authority, key: b"\xc1 not msgpack",
        lambda authority, key: msgpack.packb([RUN, 9, [[b"short", 1.0]], b""], use_bin_type=True),
        lambda authority, key: msgpack.packb([RUN, True, [], b""], use_bin_type=True),
    ],
    ids=["other-signer", "other-run", "tampered", "garbage", "bad-key", "bad-serial"],
)
def test_a_forged_or_malformed_list_is_refused(forge: Any) -> None:
    authority, victim = Identity(), Identity()
    book = RevocationBook(authority.public_key, RUN)
    with pytest.raises(AuthenticationError):
        book.offer(forge(authority, victim.public_key))
    assert book.current is None and not book.revoked(victim.public_key, 0.0)


# ------------------------------------------------------------------------------ the swarm


def test_a_ban_reaches_every_peer_within_a_gossip_period_and_shuts_the_peer_out(
    vloop: VirtualTimeLoop,  # noqa: F811
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Only Alice hears of the ban (from the coordinator, say); Carol cannot reach her.
    Within one gossip period every honest peer holds the list, has no link to Mallory, and has dropped Mallory's
    records and membership; Mallory cannot link again, and what she stores stays hers."""

    async def main() -> tuple[Any, ...]:
        loop = asyncio.get_running_loop()
        net = MemoryNetwork(latency=0.01)
        net.cut(["alice"], ["carol"])  # the list reaches Carol through Bob
        nodes, authority, _ = await _certified(["bob", "alice", "carol", "mallory"], net)
        bob, alice, carol, mallory = nodes
        honest = (alice, bob, carol)
        assert await wait_until_async(lambda: all(len(n.members()) == 4 for n in nodes), 30.0, 0.1)
        await mallory.store("m.progress", 1, mallory.now() + 600)
        assert await wait_until_async(
            lambda: all(n.store_.get("m.progress", n.now()) is not None for n in honest), 30.0, 0.1
        )
        started = loop.time()
        assert alice.revoke(_list(authority, 1, mallory.identity.public_key))

        def shut_out() -> bool:
            return all(
                n.trust.revocations is not None
                and n.trust.revocations.serial == 1
                and mallory.peer_id not in n.pool.by_peer
                and mallory.peer_id not in n.members()
                and n.store_.get("m.progress", n.now()) is None
                for n in honest
            )

        assert await wait_until_async(shut_out, 5.0, 0.1)
        took = loop.time() - started
        refused = []
        for target in (alice, carol):
            try:  # the handshake may complete on her side before the target says no
                link = await mallory.link(target.peer_id, target.visible_addresses)
            except SwarmgradError:
                refused.append(target.peer_id)
                continue
            if await wait_until_async(lambda link=link: link.closed, 5.0, 0.1):
                refused.append(target.peer_id)
        linked = [n.peer_id for n in honest if mallory.peer_id in n.pool.by_peer]
        await mallory.store("m.later", 2, mallory.now() + 600)
        await asyncio.sleep(3.0)  # gossip rounds that would carry it
        leaked = [n.peer_id for n in honest if n.store_.get("m.later", n.now()) is not None]
        again = alice.revoke(_list(authority, 1, mallory.identity.public_key))
        for node in nodes:
            await node.shutdown()
        return took, refused, linked, leaked, again, mallory.peer_id

    with caplog.at_level(logging.WARNING, logger="peer.node"):
        took, refused, linked, leaked, again, mallory_id = vloop.run_until_complete(main())
    assert took <= 1.0, f"the ban took {took:.2f} s of virtual time, more than a gossip period"
    assert len(refused) == 2 and linked == [] and leaked == []
    assert again is False
    closing = [r.getMessage() for r in caplog.records if "banned it" in r.getMessage()]
    assert closing and all(mallory_id in m for m in closing)
    assert any(f"peer {mallory_id} is banned" in r.getMessage() for r in caplog.records)


def test_a_forged_ban_is_refused_and_its_sender_dropped(
    vloop: VirtualTimeLoop,  # noqa: F811
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Mallory signs a list banning Alice with her own key and sends it to Carol: Carol
    refuses it, drops Mallory's link naming her, and keeps Alice."""

    async def main() -> tuple[Any, ...]:
        net = MemoryNetwork(latency=0.01)
        (alice, carol, mallory), _, _ = await _certified(["alice", "carol", "mallory"], net)
        assert await wait_until_async(
            lambda: all(len(n.members()) == 3 for n in (alice, carol, mallory)), 30.0, 0.1
        )
        forged = RevocationList.issue(
            mallory.identity, run_id=RUN, serial=10**9, entries=[(alice.identity.public_key, 2e9)]
        ).to_bytes()
        link = await mallory.link(carol.peer_id)
        await link.send(Frame(LINK_REVOCATIONS, {"list": forged}))
        closed = await wait_until_async(lambda: link.closed, 5.0, 0.1)
        kept = alice.peer_id in carol.members() and carol.trust.revocations is not None
        serial = carol.trust.revocations.serial if carol.trust.revocations is not None else None
        for node in (alice, carol, mallory):
            await node.shutdown()
        return closed, kept, serial, mallory.peer_id

    with caplog.at_level(logging.WARNING, logger="peer"):
        closed, kept, serial, mallory_id = vloop.run_until_complete(main())
    assert closed and kept and serial == -1
    assert any(
        mallory_id in r.getMessage() and "forged revocation list" in r.getMessage()
        for r in caplog.records
    ), [r.getMessage() for r in caplog.records]
