"""What a DiLoCo volunteer's checkpoint holds: the outer (synchronised) parameters and the
outer optimizer's state, not the model's inner parameters of the round under way."""

from __future__ import annotations

import io
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from peer import DiLoCo, Node
from peer.volunteer import JoinOptions, Volunteer, _Trainer
from tests.conftest import scaled


class Uploads:
    """The coordinator client's checkpoint upload, kept."""

    def __init__(self) -> None:
        self.got: list[tuple[int, bytes]] = []

    def upload_checkpoint(self, token: str, run_id: str, epoch: int, data: bytes) -> None:
        self.got.append((epoch, data))


def test_a_diloco_checkpoint_holds_the_outer_parameters_mid_round(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    node = Node(gossip_period=0.2)
    opt = DiLoCo(
        node=node,
        run_id="diloco-checkpoint",
        params=model.parameters(),
        inner_optimizer=lambda p: torch.optim.AdamW(p, lr=1e-2),
        inner_steps=3,
        matchmaking_time=scaled(0.5),
        load_state_timeout=scaled(2),
    )
    client = Uploads()
    answer = SimpleNamespace(peer_id=node.peer_id, peer_token="sgp_x", run_id="r", config={})
    volunteer = Volunteer(JoinOptions("http://c", "sgj_x", data_dir=tmp_path))
    task = SimpleNamespace(name="t")
    config = SimpleNamespace(checkpoint_every=1)
    trainer = _Trainer(volunteer, client, answer, None, task, config, model, opt)
    try:
        g = torch.Generator().manual_seed(1)
        for _ in range(4):  # a sync (alone: its own pseudo-gradient), then one inner step
            x = torch.randn(8, 4, generator=g)
            torch.nn.functional.mse_loss(model(x), x.sum(1, keepdim=True).sin()).backward()
            opt.step(batch_size=8)
            opt.zero_grad()
        assert opt.outer_step == 1
        inner = [p.detach().clone() for p in model.parameters()]
        assert not all(torch.equal(a, b) for a, b in zip(inner, opt.outer_params, strict=True))
        trainer._maybe_upload()
        assert trainer.upload is not None
        trainer.upload.result(timeout=scaled(30))
        with pytest.raises(ValueError, match="none of the parameters"):
            opt.synchronised_state_dict(torch.nn.Linear(4, 8))
    finally:
        trainer.close()
        opt.shutdown()
        node.shutdown()
    ((epoch, data),) = client.got
    saved: dict[str, Any] = torch.load(io.BytesIO(data), weights_only=True)
    assert epoch == saved["epoch"] == 1
    names = [name for name, _ in model.named_parameters()]
    assert list(saved["model"]) == list(model.state_dict())
    for name, outer, mine in zip(names, opt.outer_params, inner, strict=True):
        assert torch.equal(saved["model"][name], outer), name
        assert not torch.equal(saved["model"][name], mine) or torch.equal(outer, mine)
    assert saved["optimizer"]["sync"] == 1
    assert saved["optimizer"]["outer_optimizer"]["state"], "the outer momentum is kept"
    for a, b in zip(saved["optimizer"]["outer_params"], opt.outer_params, strict=True):
        assert torch.equal(a, b)
    # a volunteer resuming from it starts the model at the outer parameters
    resumed = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    resumed.load_state_dict(saved["model"])
    for p, outer in zip(resumed.parameters(), opt.outer_params, strict=True):
        assert torch.equal(p.detach(), outer)
