"""State download from a live donor."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from peer import DecentralizedAverager
from swarmlab.averager_process import AveragerProcess
from tests.conftest import scaled
from tests.peer.averaging.conftest import wait_for


class Named(DecentralizedAverager):
    """Shares metadata naming itself, to tell donors apart."""

    def get_current_state(self) -> tuple[Any, Any]:
        return {"name": self.name, "epoch": 7, "blob": b"\x00\x01"}, self._averaged_tensors


def test_newcomer_downloads_from_the_highest_priority_allowed_donor(make_swarm) -> None:
    swarm = make_swarm(4)
    tensors = [[torch.randn(3000), torch.randn(2, 3), torch.zeros(0)] for _ in range(4)]
    donors = []
    for i, (priority, allow) in enumerate([(1.0, True), (9.0, False), (5.0, True)]):
        donor = Named(
            tensors[i],
            swarm.nodes[i],
            start=False,
            prefix="state",
            allow_state_sharing=allow,
            part_size_bytes=1024,
        )
        donor.name = f"donor{i}"
        donor.state_sharing_priority = priority
        donor.run()
        donors.append(donor)
    swarm.averagers.extend(donors)
    newcomer = DecentralizedAverager(
        [torch.zeros(3000), torch.zeros(2, 3), torch.zeros(0)],
        swarm.nodes[3],
        start=True,
        prefix="state",
    )
    swarm.averagers.append(newcomer)

    def load(expected: str) -> Any:
        loaded = newcomer.load_state_from_peers(timeout=scaled(10))
        return loaded if loaded is not None and loaded[0]["name"] == expected else None

    loaded = wait_for(lambda: load("donor2"), 15)  # 9.0 is not sharing; 5.0 beats 1.0
    assert loaded is not None
    metadata, state = loaded
    assert metadata == {"name": "donor2", "epoch": 7, "blob": b"\x00\x01"}
    for got, want in zip(state, tensors[2], strict=True):
        assert torch.equal(got, want)
    # the best donor stops sharing: the next one is used
    donors[2].allow_state_sharing = False
    loaded = wait_for(lambda: load("donor0"), 15)
    assert loaded is not None
    assert all(torch.equal(g, w) for g, w in zip(loaded[1], tensors[0], strict=True))
    for _ in range(5):  # never the one that does not share
        loaded = newcomer.load_state_from_peers(timeout=scaled(10))
        assert loaded is not None and loaded[0]["name"] == "donor0"


@pytest.mark.slow
def test_donor_killed_mid_transfer_falls_back_to_the_next(tmp_path: Path) -> None:
    config = dict(prefix="state", part_size_bytes=4096)
    big = [torch.randn(200_000), torch.randn(5)]
    small_priority = [torch.randn(200_000), torch.randn(5)]
    torch.save(big, tmp_path / "a.pt")
    torch.save(small_priority, tmp_path / "b.pt")
    torch.save([torch.zeros(200_000), torch.zeros(5)], tmp_path / "c.pt")
    procs: list[AveragerProcess] = []
    try:
        best = AveragerProcess(str(tmp_path / "a.pt"), config=config, fault="kill_mid_state")
        procs.append(best)
        second = AveragerProcess(
            str(tmp_path / "b.pt"), initial_peers=best.addresses, config=config
        )
        procs.append(second)
        newcomer = AveragerProcess(
            str(tmp_path / "c.pt"), initial_peers=best.addresses, config=config
        )
        procs.append(newcomer)
        best.call(cmd="sharing", allow=True, priority=10.0)
        second.call(cmd="sharing", allow=True, priority=1.0)
        assert wait_for(lambda: all(p.call(cmd="members")["members"] == 3 for p in procs), 20)
        # both declarations must have reached the newcomer before it picks a donor
        assert wait_for(
            lambda: newcomer.call(cmd="donors")["donors"] == [best.peer_id, second.peer_id], 20
        )
        reply = newcomer.call(cmd="load_state", out=str(tmp_path / "out.pt"), timeout=30)
        assert reply["ok"], reply
        best.proc.wait(timeout=scaled(30))
        assert best.proc.returncode == -9  # the best donor died mid-transfer ...
        assert reply["donor"] == second.peer_id  # ... and the next one delivered
        state = torch.load(tmp_path / "out.pt", weights_only=True)
        assert all(torch.equal(g, w) for g, w in zip(state, small_priority, strict=True))
    finally:
        for p in procs:
            p.kill()
