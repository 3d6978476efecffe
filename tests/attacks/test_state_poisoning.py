"""A hostile DiLoCo peer claims the next sync and serves outer state of its own making.
Honest DiLoCo peers with the run's defaults (a short matchmaking time aside), in one
process over loopback; the hostile peer reports the sync and declares itself its donor."""

from __future__ import annotations

import logging

import pytest
import torch

from peer import Node
from swarmlab.node_process import wait_until
from tests.attacks.conftest import Attack
from tests.conftest import scaled
from tests.peer.optim.diloco_peers import Forger, Trainer, make_nodes

POISON = 1000.0
#: honest outer values stay near the initialisation's (|w| < 1); the poison is 1000
HONEST_BOUND = 50.0


def _train_together(trainers: list[Trainer], sync: int) -> None:
    for t in trainers:
        t.train_until(sync)
    assert wait_until(lambda: all(t.done() for t in trainers), scaled(120)), [
        t.sync for t in trainers
    ]
    assert all(t.sync == sync for t in trainers), [t.sync for t in trainers]


def _same_state(trainers: list[Trainer]) -> bool:
    first = trainers[0].outer_state()
    return all(
        all(torch.equal(a, b) for a, b in zip(first, t.outer_state(), strict=True))
        for t in trainers[1:]
    )


def _attack(honest: int) -> tuple[list[Trainer], Forger, list[Node]]:
    """``honest`` peers train to sync 2 together; a forger then claims sync 3."""
    nodes = make_nodes(honest + 1)
    trainers = [Trainer(nodes[i], i) for i in range(honest)]
    _train_together(trainers, 2)
    assert _same_state(trainers)
    shapes = [t.shape for t in trainers[0].outer_state()]
    forger = Forger(nodes[-1], shapes, sync=3, value=POISON)
    assert wait_until(lambda: all(forger.seen_by(t) for t in trainers), scaled(15))
    return trainers, forger, nodes


def _close(trainers: list[Trainer], forger: Forger, nodes: list[Node]) -> None:
    for t in trainers:
        t.close()
    forger.close()
    for node in nodes:
        node.shutdown()


def test_one_claim_of_the_next_sync_does_not_replace_the_honest_outer_state(
    attack: Attack, caplog: pytest.LogCaptureFixture
) -> None:
    """A peer claims the next DiLoCo sync and serves poisoned outer parameters

    Two honest peers at sync 2; the hostile peer reports sync 3 and serves outer state of
    1000. Each honest peer sees the swarm ahead and downloads the claimed state, but it holds
    a state of its own and replaces it only with one another volunteer confirms: the other
    honest peer holds this peer's own state, so the claim is outvoted. Guards: the holder's
    rule (``CatchUpHost.holds_state`` → ``download_state(own=...)``,
    :mod:`peer.averaging.sharing.witnesses`); without it a single claim of sync e + 1 outranks a
    peer's own state at sync e."""
    trainers, forger, nodes = _attack(honest=2)
    try:
        with caplog.at_level(logging.WARNING, logger="peer.averaging.state"):
            _train_together(trainers, 4)
        largest = max(t.largest_outer_value() for t in trainers)
        assert largest < HONEST_BOUND, f"the poisoned state was loaded: |outer| up to {largest}"
        assert all(t.adopted == [] for t in trainers), [t.adopted for t in trainers]
        assert _same_state(trainers), "the honest peers' outer states parted"
        named = [r.getMessage() for r in caplog.records if forger.node.peer_id in r.getMessage()]
        assert any("outvoted" in m or "dropped" in m for m in named), named
        attack.outcome(
            f"its state outvoted by the other honest peer and dropped, named "
            f"({sum(forger.downloads.values())} download(s) in all)"
        )
        attack.effect(f"the honest peers trained on to sync 4 with |outer| <= {largest:.2f}")
    finally:
        _close(trainers, forger, nodes)


def test_an_outvoted_claim_costs_one_download_and_no_training(
    attack: Attack, caplog: pytest.LogCaptureFixture
) -> None:
    """An outvoted claim of the next sync is retried until training stops

    Three honest peers at sync 2; the hostile peer reports sync 3 and serves outer state of
    1000. Its state is outvoted; the honest peers then download from it no more, discount
    its claim and train on: two more syncs together, each peer at most one download from
    it, no state reloaded (nothing of their progress reset), long before
    ``load_state_timeout`` (600 s) would have ended a retry loop. Guards: the refusals
    (:class:`peer.averaging.sharing.witnesses.Refusals`) and the discount of a refused donor's
    claims (``CatchUp._discount_refused``); without them every step retries the download."""
    trainers, forger, nodes = _attack(honest=3)
    try:
        before = [t.steps for t in trainers]
        with caplog.at_level(logging.WARNING, logger="peer.optim.catchup"):
            _train_together(trainers, 4)
        downloads = {t.opt.node.peer_id: forger.downloads[t.opt.node.peer_id] for t in trainers}
        assert all(n <= 1 for n in downloads.values()), downloads
        assert all(t.adopted == [] for t in trainers), [t.adopted for t in trainers]
        assert _same_state(trainers), "the honest peers' outer states parted"
        assert max(t.largest_outer_value() for t in trainers) < HONEST_BOUND
        discounted = [
            r.getMessage()
            for r in caplog.records
            if forger.node.peer_id in r.getMessage() and "ignored" in r.getMessage()
        ]
        assert discounted, "the refused donor's claim was not discounted"
        steps = [t.steps - b for t, b in zip(trainers, before, strict=True)]
        attack.outcome(
            f"downloaded at most once per honest peer ({max(downloads.values())}), its claim "
            "discounted, named"
        )
        attack.effect(
            f"the honest peers made two more syncs together in {min(steps)}-{max(steps)} "
            "steps, no state reloaded"
        )
    finally:
        _close(trainers, forger, nodes)
