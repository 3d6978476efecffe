"""A BatchNorm model trained by three ``swarmgrad join`` volunteers (``swarmgrad demo`` with a
task file), with the collaborative optimizer and with DiLoCo (its statistics averaged, or
recomputed at the outer parameters): the checkpoint loads strictly into a fresh model, its
statistics are the swarm's (not fresh ones), it holds the figure its uploader evaluated, and
the dashboard's final figure is that same number."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from peer.tasks.base import TrainingConfig
from tests.e2e.demos import run_demo

pytestmark = pytest.mark.slow

TASK_FILE = """\
import torch

from peer.tasks.base import peer_seed
from peer.tasks.digits import DigitsTask


class BatchNormDigits(DigitsTask):
    name = "bn_digits"

    def train_batches(self, config, peer_id):
        # each volunteer's inputs shifted its own way: its own running statistics would be
        # far from the others' (and its own figure far from theirs)
        shift = (peer_seed(config.seed, peer_id) % 1000) / 500.0
        for x, y in super().train_batches(config, peer_id):
            yield x + shift, y

    def build_model(self, config):
        torch.manual_seed(config.seed)
        hidden = int(config.params["hidden"])
        return torch.nn.Sequential(
            torch.nn.Linear(64, hidden),
            torch.nn.BatchNorm1d(hidden),
            torch.nn.ReLU(),
            torch.nn.Linear(hidden, 10),
        )


def make():
    return BatchNormDigits()
"""


@pytest.mark.parametrize(
    ("algorithm", "recompute"), [("collaborative", 0), ("diloco", 0), ("diloco", 10)]
)
def test_three_volunteers_share_batchnorm_statistics_into_the_checkpoint(
    tmp_path: Path, algorithm: str, recompute: int
) -> None:
    (tmp_path / "bn_digits.py").write_text(TASK_FILE)
    saved = tmp_path / "final.pt"
    epochs = 3
    demo = run_demo(
        *("--task-file", f"{tmp_path / 'bn_digits.py'}:make", "--peers", "3"),
        *("--epochs", str(epochs), "--algorithm", algorithm, "--save", str(saved)),
        *("--config", "hidden=32", "--config", f"checkpoint_every={epochs}"),
        *("--config", f"recompute_statistics={recompute}"),
        timeout=400,
    )
    assert saved.exists(), demo.output
    state = torch.load(saved, weights_only=True)
    assert state["epoch"] == epochs

    spec = importlib.util.spec_from_file_location("bn_digits_check", tmp_path / "bn_digits.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    task = module.make()
    config = TrainingConfig.from_run_config(task, state["config"])
    model = task.build_model(config)
    model.load_state_dict(state["model"], strict=True)
    counted = state["model"]["1.num_batches_tracked"]
    assert counted.dtype == torch.int64 and int(counted) == (recompute or int(counted)) > 0
    # the swarm's statistics, not a fresh layer's (the shifts average about 1)
    assert not torch.allclose(state["model"]["1.running_mean"], torch.zeros(32), atol=1e-3)
    figure = float(task.evaluate(model, config))
    assert state["metric"] == pytest.approx(figure, abs=1e-9)
    # what the dashboard showed last: the mean of the volunteers' latest figures, each of the
    # model the swarm agrees on at the last epoch
    final = [p for p in demo.seen if p["epoch"] >= epochs and p.get("eval_metric") is not None]
    assert final, demo.output
    assert final[-1]["eval_metric"] == pytest.approx(figure, abs=1e-6), (final[-1], demo.output)
