"""Volunteers at home train as one swarm: six ``swarmgrad join URL --token T`` behind six home
routers (two endpoint-independent, two symmetric, one that blocks UDP, one with UPnP and
NAT-PMP), none reachable by itself (the last one asks its router for a port forward), a coordinator
and a relay on the public side. Every round after the first is one group of all six, and all
six end the run with the same parameters (their ``--save-final`` files, bit for bit).

Needs root, nftables and miniupnpd (``make test`` brings them); skipped elsewhere with the
reason, and a failure under ``CI=true``.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from swarmlab.natlab import Link, RouterKind, unavailable
from swarmlab.natrun import NatRun
from tests.conftest import scaled

pytestmark = pytest.mark.slow

KINDS = [
    RouterKind.EIM,
    RouterKind.EIM,
    RouterKind.SYMMETRIC,
    RouterKind.SYMMETRIC,
    RouterKind.UDP_BLOCKED,
    RouterKind.PORT_MAPPING,
]
EPOCHS = 8
# The digits task gathers a group for 0.5 s, enough on loopback; over 50 ms home links, with
# some pairs through a relay, six peers need longer to find each other (as a run over the
# Internet sets it), or they average in pairs.
CONFIG = [f"epochs={EPOCHS}", "matchmaking_time=2"]


def rounds_told(volunteers: list, outputs: list[str]) -> str:
    """What each volunteer said of its rounds and of the run's start, for a failure."""
    said = ("resumed", "running", "failed", "behind", "no group", "loaded state")
    return "\n".join(
        f"--- volunteer {k} ({KINDS[k].value}): groups {volunteer.groups()}\n"
        + "\n".join(line for line in output.splitlines() if any(w in line for w in said))
        for k, (volunteer, output) in enumerate(zip(volunteers, outputs, strict=True))
    )


def test_six_volunteers_behind_home_routers_average_as_one_swarm(tmp_path: Path) -> None:
    reason = unavailable(KINDS)
    if reason is not None:
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(f"the NAT lab is needed in CI: {reason}", pytrace=False)
        pytest.skip(reason)
    with NatRun(KINDS, tmp_path, link=Link(50, 50), config=CONFIG) as run:
        volunteers = run.join_all(save_final=True)
        for volunteer in volunteers:
            volunteer.process.wait(scaled(600))
        connections = run.connections()
        relayed_bytes = run.relay_stats().get("bytes_carried", 0)
        outputs = [v.output() for v in volunteers]
        finals = [run.final_path(k) for k in range(len(KINDS))]
    print(f"\n{'pair of routers':<28} connected")
    for (a, b), how in sorted(connections.items()):
        print(f"{KINDS[a].value:>12} - {KINDS[b].value:<13} {how}")
    print(f"the relay carried {relayed_bytes} bytes")
    for k, volunteer in enumerate(volunteers):
        assert volunteer.process.returncode == 0, f"volunteer {k}:\n{outputs[k][-3000:]}"
        assert "Traceback" not in outputs[k], outputs[k]
        if KINDS[k] is RouterKind.PORT_MAPPING:  # it asks its router for a port forward
            assert "the router forwards it, by UPnP" in outputs[k], outputs[k][-3000:]
        else:
            assert "behind a NAT" in outputs[k] and "hole punching" in outputs[k]
        groups = volunteer.groups()
        # every round after the first, until the run's last epoch: one group of all six
        rounds = {epoch: size for epoch, size in groups.items() if 2 <= epoch < EPOCHS}
        assert rounds and all(size == len(KINDS) for size in rounds.values()), (
            f"volunteer {k} ({KINDS[k].value}) averaged in groups {groups}\n"
            + rounds_told(volunteers, outputs)
        )
    for (a, b), how in connections.items():
        if RouterKind.PORT_MAPPING in (KINDS[a], KINDS[b]):
            assert how == "mapped", f"{KINDS[a].value}-{KINDS[b].value}: {how}"
        elif {RouterKind.SYMMETRIC, RouterKind.UDP_BLOCKED} & {KINDS[a], KINDS[b]}:
            # linked, directly or through the relay (a TCP punch usually gets through a
            # router that blocks UDP, but one that missed stays relayed until the next minute)
            assert how != "none", f"{KINDS[a].value}-{KINDS[b].value}: never linked"
        else:  # neither side symmetric nor blocking UDP: without the relay
            assert how == "punched", f"{KINDS[a].value}-{KINDS[b].value}: {how}"
    # one all-reduce result and the same optimizer step on every peer, every round: the six
    # final models are the same, bit for bit (integer counters are each volunteer's own)
    states = [torch.load(path, weights_only=True) for path in finals]
    first = states[0]["model"]
    for k, state in enumerate(states):
        assert state["epoch"] == EPOCHS, f"volunteer {k} saved epoch {state['epoch']}"
        assert state["model"].keys() == first.keys()
        for name, tensor in state["model"].items():
            if tensor.is_floating_point():
                assert torch.equal(tensor, first[name]), f"volunteer {k} differs in {name}"
