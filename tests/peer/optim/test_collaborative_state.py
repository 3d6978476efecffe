"""A newcomer starts from the swarm's state: the freshest donor, retried while none answers.

Three nodes in one process over loopback WebSockets. A peer is put ahead of the others with
``load_state_dict`` (epoch 5, recognisable parameters), so no training is needed.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from functools import partial
from typing import Any

import pytest
import torch

import peer.averaging.sharing.download as state_module
from peer import Node
from peer.averaging.sharing.download import state_key
from peer.optim.collaborative.optimizer import Optimizer
from peer.optim.shared.optimizer_state import StateSharingAverager
from peer.optim.shared.progress import progress_key
from tests.conftest import scaled
from tests.peer.averaging.conftest import wait_for

RUN = "late"


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))


def _optimizer(node: Node, model: torch.nn.Module, load_state_timeout: float) -> Optimizer:
    return Optimizer(
        node=node,
        run_id=RUN,
        target_batch_size=8,
        batch_size_per_step=4,
        optimizer=partial(torch.optim.SGD, lr=0.1, momentum=0.5),
        params=model.parameters(),
        matchmaking_time=1.0,
        load_state_timeout=load_state_timeout,
    )


@pytest.fixture
def nodes() -> Iterator[list[Node]]:
    a = Node(gossip_period=0.2)
    others = [Node(a.visible_addresses, gossip_period=0.2) for _ in range(2)]
    everyone = [a, *others]
    assert wait_for(lambda: all(len(n.members()) == 3 for n in everyone), 15)
    yield everyone
    for node in reversed(everyone):
        node.shutdown()


def _put_ahead(opt: Optimizer, model: torch.nn.Module, epoch: int) -> list[torch.Tensor]:
    """Make ``opt`` a peer at ``epoch`` with parameters nobody else has; those parameters."""
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    opt.load_state_dict({**opt.state_dict(), "local_epoch": epoch})
    return [p.detach().clone() for p in model.parameters()]


def _declarations(node: Node) -> dict[str, Any]:
    """The state donors ``node`` knows: peer id → declared priority (None: retracted)."""
    record = node.get(state_key(f"{RUN}_state_averager"))
    if record is None or not isinstance(record.value, dict):
        return {}
    return {peer_id: item.value for peer_id, item in record.value.items()}


def _sees_epoch(node: Node, peer_id: str, epoch: int) -> bool:
    record = node.get(progress_key(RUN))
    return (
        record is not None
        and isinstance(record.value, dict)
        and peer_id in record.value
        and record.value[peer_id].value[0] == epoch
    )


def test_newcomer_downloads_the_newest_state_not_a_stragglers(
    nodes: list[Node], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Donors are ordered by priority, and at random among equal priorities; here ties go
    to the straggler. Were every donor's priority equal (as it was), the newcomer would get
    the straggler's epoch-0 state while the swarm is at epoch 5."""
    a, b, c = nodes
    models = [_model() for _ in range(3)]
    began = time.monotonic()
    ahead = _optimizer(a, models[0], scaled(30))
    assert time.monotonic() - began < scaled(10), "the first peer has no one to wait for"
    straggler = _optimizer(b, models[1], scaled(30))
    opts = [ahead, straggler]
    try:
        expected = _put_ahead(ahead, models[0], 5)
        assert ahead.state_averager.state_sharing_priority == 5.0
        assert straggler.state_averager.state_sharing_priority == 0.0
        # c knows both donors, each as it currently declares itself, and the swarm's epoch
        current = {
            a.peer_id: ahead.state_averager.state_sharing_priority,
            b.peer_id: straggler.state_averager.state_sharing_priority,
        }
        assert wait_for(lambda: _declarations(c) == current and _sees_epoch(c, a.peer_id, 5), 15)
        real_list_donors = state_module.list_donors

        async def straggler_wins_ties(
            core: Any, prefix: str, prefer: frozenset[str] = frozenset()
        ) -> list[tuple[float, str]]:
            donors = await real_list_donors(core, prefix, prefer)
            return sorted(donors, key=lambda d: (-d[0], d[1] != b.peer_id))

        monkeypatch.setattr(state_module, "list_donors", straggler_wins_ties)
        newcomer = _optimizer(c, models[2], scaled(10))
        opts.append(newcomer)
        assert newcomer.local_epoch == 5
        assert newcomer.state_averager.last_state_donor == a.peer_id
        assert newcomer.state_averager.state_sharing_priority == 5.0  # it now serves epoch 5
        for mine, theirs in zip(models[2].parameters(), expected, strict=True):
            assert torch.equal(mine.detach(), theirs)
    finally:
        for opt in opts:
            opt.shutdown()


def test_newcomer_waits_for_a_donor_while_the_swarm_is_ahead(
    nodes: list[Node], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The swarm is at epoch 5 but its only donor is not declared (yet): the newcomer's first
    download finds no one. It retries, and gets the state once the donor declares itself,
    instead of starting from scratch."""
    a, _, c = nodes
    models = [_model(), _model()]
    ahead = _optimizer(a, models[0], scaled(30))
    opts = [ahead]
    attempts: list[Any] = []
    first_failed = threading.Event()
    original = StateSharingAverager.load_state_from_peers

    def observed(self: StateSharingAverager, *args: Any, **kwargs: Any) -> Any:
        result = original(self, *args, **kwargs)
        attempts.append(result)
        if result is None:
            first_failed.set()
        return result

    try:
        expected = _put_ahead(ahead, models[0], 5)
        ahead.state_averager.allow_state_sharing = False
        assert wait_for(
            lambda: _declarations(c).get(a.peer_id) is None and _sees_epoch(c, a.peer_id, 5), 15
        )
        monkeypatch.setattr(StateSharingAverager, "load_state_from_peers", observed)
        joined: list[Optimizer] = []
        errors: list[BaseException] = []

        def join() -> None:
            try:
                joined.append(_optimizer(c, models[1], scaled(60)))
            except BaseException as exc:
                errors.append(exc)

        thread = threading.Thread(target=join)
        thread.start()
        assert first_failed.wait(scaled(30)), "the newcomer tried once and found no donor"
        ahead.state_averager.allow_state_sharing = True
        thread.join(scaled(60))
        assert not thread.is_alive()
        assert not errors, errors
        newcomer = joined[0]
        opts.append(newcomer)
        assert attempts[0] is None and attempts[-1] is not None
        assert newcomer.local_epoch == 5
        for mine, theirs in zip(models[1].parameters(), expected, strict=True):
            assert torch.equal(mine.detach(), theirs)
    finally:
        for opt in opts:
            opt.shutdown()


def test_a_peer_that_left_does_not_hold_newcomers_back(nodes: list[Node]) -> None:
    """A peer at epoch 5 shuts down (its node stays): it retracts its progress report, so a
    newcomer does not wait for the state of an epoch nobody serves any more."""
    a, _, c = nodes
    models = [_model(), _model()]
    gone = _optimizer(a, models[0], scaled(30))
    _put_ahead(gone, models[0], 5)
    assert wait_for(lambda: _sees_epoch(c, a.peer_id, 5), 15)
    gone.shutdown()
    began = time.monotonic()
    newcomer = _optimizer(c, models[1], scaled(60))
    try:
        assert newcomer.local_epoch == 0
        assert time.monotonic() - began < scaled(20), "it waited for a peer that left"
    finally:
        newcomer.shutdown()


def test_a_swarm_led_by_client_mode_peers_is_caught_up_with_not_waited_for() -> None:
    """The only peer ahead is in client mode: it cannot be dialled, so it shares no state.
    A reachable peer that falls behind it moves to its epoch with its own parameters at
    once, instead of retrying a download nobody can serve for ``load_state_timeout``."""
    with (
        Node(gossip_period=0.2) as reachable,
        Node(reachable.visible_addresses, gossip_period=0.2, client_mode=True) as hidden,
    ):
        assert wait_for(lambda: len(reachable.members()) == 2, 15)
        models = [_model(), _model()]
        ahead = _optimizer(hidden, models[0], scaled(30))
        behind = _optimizer(reachable, models[1], scaled(120))
        try:
            _put_ahead(ahead, models[0], 5)
            assert wait_for(lambda: _sees_epoch(reachable, hidden.peer_id, 5), 15)
            own = [p.detach().clone() for p in models[1].parameters()]
            began = time.monotonic()
            assert behind.load_state_from_peers() is False  # nothing was downloaded
            assert time.monotonic() - began < scaled(20), "it waited for a donor that cannot be"
            assert behind.local_epoch == 5
            for mine, before in zip(models[1].parameters(), own, strict=True):
                assert torch.equal(mine.detach(), before)
        finally:
            behind.shutdown()
            ahead.shutdown()
