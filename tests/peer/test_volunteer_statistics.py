"""A volunteer evaluates and uploads the model the swarm agrees on: with DiLoCo, the outer
parameters with the outer buffers; with ``recompute_statistics``, batch-norm statistics
recomputed at those parameters on the batches every volunteer draws alike."""

from __future__ import annotations

import io
import itertools
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from peer import DiLoCo, Node
from peer.optim import model_buffers
from peer.trainer import STATISTICS_STREAM, Trainer
from peer.volunteer import JoinOptions, Volunteer
from tests.conftest import scaled
from tests.peer.test_volunteer_diloco import Uploads


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.Tanh(), torch.nn.Linear(8, 1)
    )


class Task:
    """Batches fixed by the stream's name; the metric: the held-out mse."""

    name = "bn-sine"

    def train_batches(self, config: Any, peer_id: str) -> Iterator[torch.Tensor]:
        g = torch.Generator().manual_seed(sum(peer_id.encode()))
        while True:
            yield torch.randn(8, 4, generator=g) * 2 + 1

    def loss(self, model: torch.nn.Module, batch: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.mse_loss(model(batch), batch.sum(1, keepdim=True).sin())

    def evaluate(self, model: torch.nn.Module, config: Any) -> float:
        was = model.training
        model.eval()
        try:
            with torch.no_grad():
                x = torch.linspace(-2, 2, 64).unsqueeze(1).repeat(1, 4)
                return float(self.loss(model, x))
        finally:
            model.train(was)


@pytest.mark.parametrize("recompute", [0, 3])
def test_the_uploaded_statistics_are_the_outer_ones_or_recomputed_at_the_outer_parameters(
    tmp_path: Path, recompute: int
) -> None:
    model = make_model()
    node = Node(gossip_period=0.2)
    opt = DiLoCo(
        node=node,
        run_id="diloco-statistics",
        params=model.parameters(),
        buffers=model_buffers(model),
        inner_optimizer=lambda p: torch.optim.AdamW(p, lr=1e-2),
        inner_steps=3,
        matchmaking_time=scaled(0.5),
        load_state_timeout=scaled(2),
    )
    client = Uploads()
    answer = SimpleNamespace(peer_id=node.peer_id, peer_token="sgp_x", run_id="r", config={})
    volunteer = Volunteer(JoinOptions("http://c", "sgj_x", data_dir=tmp_path))
    task = Task()
    config = SimpleNamespace(checkpoint_every=1, recompute_statistics=recompute)
    trainer = Trainer(volunteer, client, answer, None, task, config, model, opt)
    try:
        for batch in itertools.islice(task.train_batches(config, "own"), 4):
            task.loss(model, batch).backward()  # a sync (alone), then one inner step
            opt.step(batch_size=8)
            opt.zero_grad()
        assert opt.outer_step == 1
        own = {k: v.detach().clone() for k, v in model.state_dict().items()}
        outer = opt.synchronised_state_dict(model)
        trainer._maybe_upload()
        assert trainer.upload is not None
        trainer.upload.result(timeout=scaled(30))
        # the model keeps its own inner steps and statistics
        for key, value in model.state_dict().items():
            assert torch.equal(value, own[key]), key
    finally:
        trainer.close()
        opt.shutdown()
        node.shutdown()
    ((_, data),) = client.got
    saved = torch.load(io.BytesIO(data), weights_only=True)["model"]
    expected = make_model()
    expected.load_state_dict(outer, strict=True)
    # the outer statistics: the sync's (4 forward passes then; one inner step since)
    assert int(outer["1.num_batches_tracked"]) == 3
    assert not torch.equal(outer["1.running_mean"], own["1.running_mean"])
    if recompute:
        norm = expected[1]
        assert isinstance(norm, torch.nn.BatchNorm1d)
        norm.reset_running_stats()
        norm.momentum = None
        with torch.no_grad():
            for batch in itertools.islice(task.train_batches(config, STATISTICS_STREAM), recompute):
                expected(batch)
        norm.momentum = 0.1
    fresh = make_model()
    fresh.load_state_dict(saved, strict=True)
    for key, value in expected.state_dict().items():
        torch.testing.assert_close(saved[key], value, atol=1e-6, rtol=0, msg=key)
    assert int(saved["1.num_batches_tracked"]) == (recompute or 3)
    assert trainer.eval_metric == pytest.approx(task.evaluate(fresh, config), abs=1e-9)
