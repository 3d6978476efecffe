"""A newcomer's preferred donors: asked first among donors of equal priority, never over a
donor of higher priority."""

from __future__ import annotations

from typing import Any

import torch

from peer import DecentralizedAverager
from tests.conftest import scaled
from tests.peer.averaging.conftest import wait_for


class Named(DecentralizedAverager):
    """Shares metadata naming itself, to tell donors apart."""

    name = ""

    def get_current_state(self) -> tuple[Any, Any]:
        return {"name": self.name}, self._averaged_tensors


def test_preferred_donors_go_first_among_equal_priorities(make_swarm) -> None:
    swarm = make_swarm(5)
    donors = []
    for i in range(4):
        donor = Named([torch.full((8,), float(i))], swarm.nodes[i], start=False, prefix="state")
        donor.name = f"donor{i}"
        donor.state_sharing_priority = 1.0
        donor.run()
        donors.append(donor)
    swarm.averagers.extend(donors)
    newcomer = DecentralizedAverager([torch.zeros(8)], swarm.nodes[4], start=True, prefix="state")
    swarm.averagers.append(newcomer)

    def load(prefer: list[str]) -> str | None:
        loaded = newcomer.load_state_from_peers(timeout=scaled(10), prefer=prefer)
        return None if loaded is None else loaded[0]["name"]

    # every donor declared: without a preference, more than one of them serves
    assert wait_for(lambda: len({load([]) for _ in range(12)} - {None}) > 1, 20)
    wanted = [donors[2].peer_id]
    assert {load(wanted) for _ in range(8)} == {"donor2"}  # one in four by chance: 4**-8
    # a newer state beats the preference
    donors[3].state_sharing_priority = 2.0
    assert wait_for(lambda: load(wanted) == "donor3", 15)
