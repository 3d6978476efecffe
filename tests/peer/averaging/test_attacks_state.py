"""A hostile state donor: what it claims is checked before this peer acts on it."""

from __future__ import annotations

import logging
from typing import Any

import pytest
import torch

from peer.averaging.averager import DecentralizedAverager
from peer.averaging.sharing.download import state_key
from tests.conftest import scaled
from tests.peer.averaging.conftest import wait_for


def _donors_declared(newcomer: DecentralizedAverager, count: int) -> bool:
    """Whether ``newcomer`` sees ``count`` state donors declared."""
    record = newcomer.node.get(state_key("test"))
    return record is not None and len(record.value) >= count


def _priority_seen(newcomer: DecentralizedAverager, donor: DecentralizedAverager) -> float | None:
    """The priority ``newcomer`` sees ``donor`` declare (None: none yet)."""
    record = newcomer.node.get(state_key("test"))
    item = record.value.get(donor.node.peer_id) if record is not None else None
    return getattr(item, "value", None)


def _priorities_seen(
    newcomer: DecentralizedAverager, declared: dict[DecentralizedAverager, float]
) -> bool:
    """Whether ``newcomer`` sees every donor of ``declared`` declare its priority there."""
    return all(_priority_seen(newcomer, donor) == value for donor, value in declared.items())


class _Bloated(DecentralizedAverager):
    """Serves a state far larger than any peer of this run holds."""

    def get_current_state(self) -> tuple[Any, list[torch.Tensor]]:
        return {"epoch": 99}, [torch.zeros(6 << 20)]  # 24 MiB where 4 KB are expected


def test_a_donor_claiming_a_huge_state_is_skipped(
    make_swarm, caplog: pytest.LogCaptureFixture
) -> None:
    """The bloated donor has the top priority: the newcomer refuses its announced size
    before allocating anything, names it, and takes the honest donor's state."""
    swarm = make_swarm(3)
    base = dict(prefix="test", min_matchmaking_time=1.0, request_timeout=3.0, start=True)
    honest = DecentralizedAverager(
        [torch.full((1000,), 2.0)], swarm.nodes[0], allow_state_sharing=True, **base
    )
    hostile = _Bloated([torch.zeros(1000)], swarm.nodes[1], allow_state_sharing=True, **base)
    newcomer = DecentralizedAverager([torch.zeros(1000)], swarm.nodes[2], **base)
    swarm.averagers += [honest, hostile, newcomer]
    honest.state_sharing_priority = 1.0
    hostile.state_sharing_priority = 100.0

    assert wait_for(lambda: _priorities_seen(newcomer, {honest: 1.0, hostile: 100.0}), 15)
    with caplog.at_level(logging.WARNING, logger="peer.averaging.state"):
        found = newcomer.load_state_from_peers(timeout=scaled(30))
    assert found is not None
    _, tensors = found
    assert torch.equal(tensors[0], torch.full((1000,), 2.0))
    assert newcomer.last_state_donor == honest.node.peer_id
    refusals = [r.getMessage() for r in caplog.records if "expects at most" in r.getMessage()]
    assert refusals and hostile.node.peer_id in refusals[0]


class _Liar(DecentralizedAverager):
    """Serves other weights than the swarm's (and the digest of what it serves)."""

    def get_current_state(self) -> tuple[Any, list[torch.Tensor]]:
        return {"epoch": 99}, [torch.full((1000,), -7.0)]


def test_a_donor_serving_wrong_weights_is_outvoted_by_the_honest_donors(
    make_swarm, caplog: pytest.LogCaptureFixture
) -> None:
    """The liar claims the top priority, so its state is downloaded first; the two honest
    donors, asked for their states' digests, agree with each other and not with it: its
    state is dropped, it is named, and the newcomer takes the honest state."""
    swarm = make_swarm(4)
    base = dict(prefix="test", min_matchmaking_time=1.0, request_timeout=3.0, start=True)
    honest = [
        DecentralizedAverager(
            [torch.full((1000,), 2.0)], swarm.nodes[i], allow_state_sharing=True, **base
        )
        for i in (0, 1)
    ]
    liar = _Liar([torch.zeros(1000)], swarm.nodes[2], allow_state_sharing=True, **base)
    newcomer = DecentralizedAverager([torch.zeros(1000)], swarm.nodes[3], **base)
    swarm.averagers += [*honest, liar, newcomer]
    for averager in honest:
        averager.state_sharing_priority = 1.0
    liar.state_sharing_priority = 100.0

    assert wait_for(
        lambda: _priorities_seen(newcomer, {honest[0]: 1.0, honest[1]: 1.0, liar: 100.0}), 15
    )
    with caplog.at_level(logging.WARNING, logger="peer.averaging.state"):
        found = newcomer.load_state_from_peers(timeout=scaled(30))
    assert found is not None
    assert torch.equal(found[1][0], torch.full((1000,), 2.0))
    assert newcomer.last_state_donor in {h.node.peer_id for h in honest}
    dropped = [r.getMessage() for r in caplog.records if "dropped" in r.getMessage()]
    assert len(dropped) == 1 and liar.node.peer_id in dropped[0], dropped
    assert "2 other donors hold another state" in dropped[0]


def test_a_state_no_other_donor_can_vouch_for_is_used_as_before(make_swarm) -> None:
    """Peers whose states all differ (as peers training alone do) cannot outvote anyone:
    the best donor's state is used, unchecked."""
    swarm = make_swarm(3)
    base = dict(prefix="test", min_matchmaking_time=1.0, request_timeout=3.0, start=True)
    donors = [
        DecentralizedAverager(
            [torch.full((10,), float(i))], swarm.nodes[i], allow_state_sharing=True, **base
        )
        for i in (0, 1)
    ]
    newcomer = DecentralizedAverager([torch.zeros(10)], swarm.nodes[2], **base)
    swarm.averagers += [*donors, newcomer]
    donors[1].state_sharing_priority = 5.0

    assert wait_for(lambda: _donors_declared(newcomer, 2), 15)
    assert wait_for(lambda: _priority_seen(newcomer, donors[1]) == 5.0, 15)
    found = newcomer.load_state_from_peers(timeout=scaled(30))
    assert found is not None and torch.equal(found[1][0], torch.full((10,), 1.0))


def test_a_donor_beyond_what_the_caller_believes_is_skipped_or_refused(
    make_swarm, caplog: pytest.LogCaptureFixture
) -> None:
    """A donor declaring a priority over ``max_priority`` is not asked; one declaring a
    believable priority but serving a state that ``check`` refuses is named and dropped.
    Either way the honest donor's state is taken."""
    swarm = make_swarm(3)
    base = dict(prefix="test", min_matchmaking_time=1.0, request_timeout=3.0, start=True)
    honest = DecentralizedAverager(
        [torch.full((1000,), 2.0)], swarm.nodes[0], allow_state_sharing=True, **base
    )
    hostile = _Liar([torch.zeros(1000)], swarm.nodes[1], allow_state_sharing=True, **base)
    newcomer = DecentralizedAverager([torch.zeros(1000)], swarm.nodes[2], **base)
    swarm.averagers += [honest, hostile, newcomer]
    honest.state_sharing_priority = 4.0
    assert wait_for(lambda: _donors_declared(newcomer, 1), 15)

    def epoch_at_most_5(metadata: Any) -> str | None:
        epoch = metadata.get("epoch") if isinstance(metadata, dict) else None
        return f"epoch {epoch} is past 5" if isinstance(epoch, int) and epoch > 5 else None

    for declared, expected in ((10.0**9, "over the 5 this peer can believe"), (5.0, "past 5")):
        hostile.state_sharing_priority = declared
        assert wait_for(lambda d=declared: _priority_seen(newcomer, hostile) == d, 15)
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="peer.averaging.state"):
            found = newcomer.load_state_from_peers(
                timeout=scaled(30), max_priority=5.0, check=epoch_at_most_5
            )
        assert found is not None and torch.equal(found[1][0], torch.full((1000,), 2.0))
        assert newcomer.last_state_donor == honest.node.peer_id
        named = [r.getMessage() for r in caplog.records if hostile.node.peer_id in r.getMessage()]
        assert named and expected in named[0], named
