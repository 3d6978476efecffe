"""A hostile leader lists members that never joined its group (peer ids of no one, and an
honest peer that is not averaging) so that the honest members wait for them. Real nodes on
loopback, a run's averaging defaults.

What holds: a listed member that never began the round is unreachable, or answers traffic
for a group id it never began with ``avg.abort`` ("not a member",
``peer.averaging.allreduce.inbox.RoundInbox.route``), so each member excludes it at once; no one
waits for its parts until ``sender_timeout``. That answer is the defence this test guards:
without it the round waits 23 s here. What it costs: the spans assigned to the phantoms
keep their local values for that round, as when a member fails."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterator

import pytest
import torch

from peer.averaging.matchmaking.machine import BeginAllreduce, Declaration, GroupInfo, Notify
from peer.formats.identity import Identity
from peer.tasks import TrainingConfig, load_task
from tests.attacks.conftest import Attack
from tests.peer.averaging.conftest import Swarm, step_all

SENDER_TIMEOUT = 10.0  # the averager's default next_chunk_timeout


@pytest.fixture
def swarm() -> Iterator[Swarm]:
    swarm = Swarm(5)
    try:
        yield swarm
    finally:
        swarm.close()


def _with(group: GroupInfo, phantoms: tuple[str, ...]) -> GroupInfo:
    return dataclasses.replace(
        group,
        peer_ids=group.peer_ids + phantoms,
        gathered=group.gathered + (group.gathered[-1],) * len(phantoms),
        client_mode=group.client_mode + (False,) * len(phantoms),
    )


def test_a_leader_listing_members_that_never_joined_delays_no_one(
    swarm: Swarm, attack: Attack
) -> None:
    """A leader lists members that never joined its group (unknown ids, an idle peer)

    The honest members exclude them as soon as they find them unreachable or not in the
    round, and finish without waiting out any timeout."""
    config = TrainingConfig.from_run_config(load_task("digits"), {})
    tensors = [[torch.full((4000,), float(i))] for i in range(5)]
    averagers = swarm.add_averagers(
        tensors,
        part_size_bytes=4096,
        aggregator=config.aggregator,
        relative_weight_bound=config.relative_weight_bound,
        sender_timeout=SENDER_TIMEOUT,
    )
    idle = averagers.pop()  # an honest peer, online, not averaging this round
    # the hostile member is whichever leads (first by rank under the round's key)
    key = averagers[0]._group_key()
    leader = min(averagers, key=lambda a: Declaration(key, a.peer_id, 0.0, b"").rank)
    phantoms = (idle.peer_id, Identity().peer_id, Identity().peer_id)
    machine = leader._driver.machine
    assemble = machine._assemble

    def listing_phantoms(now: float) -> list:
        out = []
        for command in assemble(now):
            if isinstance(command, BeginAllreduce):
                command = BeginAllreduce(_with(command.group, phantoms))
            elif isinstance(command, Notify) and hasattr(command.message, "group"):
                message = dataclasses.replace(
                    command.message, group=_with(command.message.group, phantoms)
                )
                command = Notify(command.to, message)
            out.append(command)
        return out

    machine._assemble = listing_phantoms  # type: ignore[method-assign]
    began = time.monotonic()
    results = step_all(averagers, [{"timeout": 3 * SENDER_TIMEOUT}] * len(averagers))
    elapsed = time.monotonic() - began
    for result in results:
        assert isinstance(result, dict), result
        assert set(phantoms) <= set(result), "the leader listed them"
    assert elapsed < SENDER_TIMEOUT, elapsed
    attack.outcome(
        "each listed phantom excluded at once by every member (unreachable, or not in the round)"
    )
    attack.effect(
        f"the round took {elapsed:.1f} s, under the {SENDER_TIMEOUT:g} s a silent member costs"
    )
