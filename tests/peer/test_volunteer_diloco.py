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
from peer import trainer as trainer_module
from peer.formats.payloads import CheckpointHeld
from peer.trainer import Trainer
from peer.volunteer import JoinOptions, Volunteer
from tests.conftest import scaled


class Uploads:
    """The coordinator client's checkpoint upload, kept."""

    def __init__(self) -> None:
        self.got: list[tuple[int, bytes]] = []

    def upload_checkpoint(self, token: str, run_id: str, epoch: int, data: bytes) -> None:
        self.got.append((epoch, data))


def _diloco_peer(
    run_id: str, inner_steps: int, tmp_path: Path
) -> tuple[torch.nn.Sequential, Node, DiLoCo, Any, Volunteer]:
    """A small model, its node and DiLoCo optimizer, a join answer and a volunteer."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    node = Node(gossip_period=0.2)
    opt = DiLoCo(
        node=node,
        run_id=run_id,
        params=model.parameters(),
        inner_optimizer=lambda p: torch.optim.AdamW(p, lr=1e-2),
        inner_steps=inner_steps,
        matchmaking_time=scaled(0.5),
        load_state_timeout=scaled(2),
    )
    answer = SimpleNamespace(peer_id=node.peer_id, peer_token="sgp_x", run_id="r", config={})
    volunteer = Volunteer(JoinOptions("http://c", "sgj_x", data_dir=tmp_path))
    return model, node, opt, answer, volunteer


def test_a_diloco_checkpoint_holds_the_outer_parameters_mid_round(tmp_path: Path) -> None:
    model, node, opt, answer, volunteer = _diloco_peer("diloco-checkpoint", 3, tmp_path)
    client = Uploads()
    # the metric: a figure of the model it is given (the first layer's weights summed)
    task = SimpleNamespace(name="t", evaluate=lambda m, c: float(m[0].weight.detach().sum()))
    config = SimpleNamespace(checkpoint_every=1, recompute_statistics=0)
    trainer = Trainer(volunteer, client, answer, None, task, config, model, opt)
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
        # it evaluated what it uploaded, and the model kept its own inner steps
        assert trainer.eval_metric == pytest.approx(float(opt.outer_params[0].detach().sum()))
        for p, mine in zip(model.parameters(), inner, strict=True):
            assert torch.equal(p.detach(), mine)
        with pytest.raises(ValueError, match="none of the parameters"):
            opt.synchronised_state_dict(torch.nn.Linear(4, 8))
    finally:
        trainer.close()
        opt.shutdown()
        node.shutdown()
    ((epoch, data),) = client.got
    saved: dict[str, Any] = torch.load(io.BytesIO(data), weights_only=True)
    assert epoch == saved["epoch"] == 1
    assert saved["metric"] == trainer.eval_metric
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


class HoldsTwice(Uploads):
    """A coordinator that holds the first two uploads (the others' reports lag behind the
    uploader), then takes the checkpoint."""

    def upload_checkpoint(self, token: str, run_id: str, epoch: int, data: bytes) -> Any:
        super().upload_checkpoint(token, run_id, epoch, data)
        if len(self.got) <= 2:
            return CheckpointHeld(epoch=epoch, detail="the others have not reached it")
        return None


def test_an_upload_the_coordinator_held_is_sent_again_until_taken(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(trainer_module, "HELD_RETRY_FIRST_S", 0.01)
    model, node, opt, answer, volunteer = _diloco_peer("diloco-held", 1, tmp_path)
    client = HoldsTwice()
    task = SimpleNamespace(name="t", evaluate=lambda m, c: 0.0)
    config = SimpleNamespace(checkpoint_every=1, recompute_statistics=0)
    trainer = Trainer(volunteer, client, answer, None, task, config, model, opt)
    try:
        x = torch.randn(8, 4)
        torch.nn.functional.mse_loss(model(x), x.sum(1, keepdim=True)).backward()
        opt.step(batch_size=8)
        opt.zero_grad()
        assert opt.local_epoch == 1
        trainer._maybe_upload()
        assert trainer.upload is not None
        trainer.upload.result(timeout=scaled(30))
    finally:
        trainer.close()
        opt.shutdown()
        node.shutdown()
    # held twice, then taken: the same checkpoint each time
    assert [epoch for epoch, _ in client.got] == [1, 1, 1]
    assert len({data for _, data in client.got}) == 1
