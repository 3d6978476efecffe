"""Gossip subkeys that look like peers but are not: a progress report under ``"0"`` or an
upper-cased peer id (slots no peer owns, so anyone may write there). Real nodes on
loopback."""

from __future__ import annotations

import logging
import time

import pytest

from peer import Node
from peer.averaging.sharing.download import list_donors, state_key
from peer.optim.shared.progress import ProgressReport, ProgressTracker, progress_key
from swarmlab.node_process import wait_until
from tests.attacks.conftest import Attack
from tests.conftest import scaled


def test_reports_under_subkeys_that_are_not_peer_ids_count_for_nothing(
    attack: Attack, caplog: pytest.LogCaptureFixture
) -> None:
    """Write progress reports and a state donor under subkeys "0" and an upper-cased peer id"""
    alice = Node(gossip_period=0.2)
    bob = Node(alice.visible_addresses, gossip_period=0.2)
    mallory = Node(alice.visible_addresses, gossip_period=0.2)
    trackers = [ProgressTracker(node, "run", target=100) for node in (alice, bob)]
    try:
        for tracker, node in zip(trackers, (alice, bob), strict=True):
            tracker.report(ProgressReport(node.peer_id, 3, 10, 10, time.time(), 5.0, False))
            assert tracker.flush()
        key = progress_key("run")
        until = mallory.get_time() + 60
        forged = [9, 10**6, 10**6, time.time(), 1e6, False]  # far ahead, very fast
        for subkey in ("0", alice.peer_id.upper()):
            assert mallory.store(key, forged, until, subkey=subkey)

        def seen_by_bob() -> bool:
            found = bob.get(key)
            return found is not None and {"0", alice.peer_id.upper()} <= set(found.value)

        assert wait_until(seen_by_bob, scaled(15))  # the records did arrive
        with caplog.at_level(logging.WARNING, logger="peer.optim.progress"):
            reports = trackers[1].fetch(fresh=True)
        assert sorted(r.peer_id for r in reports) == sorted([alice.peer_id, bob.peer_id])
        warned = [r.getMessage() for r in caplog.records]
        assert any("'0'" in m and "not a peer id" in m for m in warned), warned
        assert any(repr(alice.peer_id.upper()) in m for m in warned), warned
        attack.outcome("both reports ignored by the progress tracker, each subkey named")
        local = ProgressReport(bob.peer_id, 3, 10, 10, time.time(), 5.0, False)
        progress = trackers[1].progress(local, reports)
        assert progress.num_peers == 2 and progress.epoch == 3
        # the checkpoint's uploader is the lowest peer id at the swarm's epoch: a real one
        assert min(r.peer_id for r in reports if r.epoch == progress.epoch) in {
            alice.peer_id,
            bob.peer_id,
        }
        # a state donor under "0" with the highest priority is no donor either
        assert mallory.store(state_key("run"), 10**9, until, subkey="0")
        assert wait_until(lambda: "0" in (bob.get(state_key("run")) or ({}, 0))[0], scaled(15))
        assert bob.run_coroutine(list_donors(bob.core, "run")) == []
        attack.outcome('a state donor declared under "0" is not asked for the state')
        attack.effect("unaffected: 2 peers at epoch 3, the uploader is one of them")
    finally:
        for tracker in trackers:
            tracker.shutdown()
        for node in (mallory, bob, alice):
            node.shutdown()
