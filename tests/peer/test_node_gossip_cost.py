"""Gossip cost per peer grows as log N, not N: two converged swarms of real nodes in
virtual time (swarmlab.gossip_cost), compared as a ratio within one run."""

from __future__ import annotations

import math

import pytest

from peer.node.cost import full_sync_chance, membership_ttl, news_rounds
from swarmlab.gossip_cost import steady_gossip

SMALL, LARGE = 40, 160


@pytest.mark.slow
@pytest.mark.alone
def test_bytes_per_peer_grow_with_log_n_and_a_record_still_reaches_everyone() -> None:
    small = steady_gossip(SMALL, window=6.0, seed=1)
    large = steady_gossip(LARGE, window=6.0, seed=1)
    log_ratio = math.log2(LARGE) / math.log2(SMALL)  # 1.38; linear growth would be 4
    ratio = large.bytes_per_peer_s / small.bytes_per_peer_s
    assert ratio < 1.5 * log_ratio, (ratio, small, large)
    # every peer still holds the whole membership, and news still reaches all of them in
    # a few rounds per doubling of the swarm
    assert large.store_records == LARGE and small.store_records == SMALL
    for cost in (small, large):
        assert cost.spread_seconds is not None, cost
        assert cost.spread_seconds <= 2 * math.log2(cost.nodes) * cost.gossip_period, cost
    # whole-store comparisons become rarer as the swarm grows
    assert large.full_share < small.full_share


def test_the_cost_model_keeps_small_swarms_as_they_were() -> None:
    assert full_sync_chance(1) == full_sync_chance(16) == 1.0
    assert full_sync_chance(1000) < 0.05
    assert membership_ttl(30.0, 10, 3600.0) == membership_ttl(30.0, 32, 3600.0) == 30.0
    assert membership_ttl(30.0, 320, 3600.0) == 300.0
    assert membership_ttl(30.0, 10**6, 3600.0) == 3600.0  # what peers accept at most
    assert news_rounds(1) == 3 and news_rounds(1000) == 12
    with pytest.raises(ValueError, match="non-negative integer"):
        news_rounds(-1)
