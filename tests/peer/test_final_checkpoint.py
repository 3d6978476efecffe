"""At the run's last epoch a volunteer whose model differs from the run's final checkpoint (its
side of a split swarm averaged apart from the uploader's) takes the checkpoint's model and
optimizer state: it then evaluates, reports and saves exactly the checkpoint's model, with
either optimizer. A volunteer that holds the checkpoint's model already, and one handed a
checkpoint that does not fit its model, change nothing.

Each volunteer is a lone peer (a node of its own) stepping as :class:`peer.trainer.Trainer`
does; the coordinator client is a stand-in that keeps the upload and serves it back.
"""

from __future__ import annotations

import io
from datetime import UTC, datetime
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from peer import DiLoCo, Node, Optimizer
from peer.formats.payloads import CheckpointPublic
from peer.optim.buffers import model_buffers
from peer.trainer import Trainer
from peer.volunteer import JoinOptions, Volunteer
from tests.conftest import scaled

STEPS = 4


class Coordinator:
    """The coordinator client's checkpoint calls: uploads kept, the newest served back (and
    announced in the run's progress, as uploaded by ``uploader``)."""

    def __init__(self) -> None:
        self.uploads: list[tuple[int, bytes]] = []
        self.served: bytes | None = None
        self.uploader = ""
        self.downloads = 0

    def progress(self, run_id: str) -> Any:
        epoch = self.uploads[-1][0] if self.uploads else None
        checkpoint = None if epoch is None else _final(epoch, self.uploader)
        return SimpleNamespace(checkpoint=checkpoint)

    def upload_checkpoint(self, token: str, run_id: str, epoch: int, data: bytes) -> None:
        self.uploads.append((epoch, data))

    def download_checkpoint(self, token: str, run_id: str) -> tuple[bytes, int] | None:
        self.downloads += 1
        if self.served is not None:
            return self.served, 0
        if not self.uploads:
            return None
        epoch, data = self.uploads[-1]
        return data, epoch


def _model(seed: int) -> torch.nn.Sequential:
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.Tanh(), torch.nn.Linear(8, 1)
    )


def _optimizer(kind: str, node: Node, model: torch.nn.Module) -> Optimizer | DiLoCo:
    if kind == "diloco":
        return DiLoCo(
            node=node,
            run_id="final-diloco",
            params=model.parameters(),
            buffers=model_buffers(model),
            inner_optimizer=lambda p: torch.optim.AdamW(p, lr=1e-2),
            inner_steps=2,
            matchmaking_time=scaled(0.5),
            load_state_timeout=scaled(2),
        )
    return Optimizer(
        node=node,
        run_id="final-collaborative",
        target_batch_size=8,
        batch_size_per_step=8,
        optimizer=lambda p: torch.optim.AdamW(p, lr=1e-2),
        params=model.parameters(),
        buffers=model_buffers(model),
        matchmaking_time=scaled(0.5),
        load_state_timeout=scaled(2),
    )


class Peer:
    """A lone volunteer: node, model, optimizer and trainer, trained on its own data."""

    def __init__(self, kind: str, seed: int, client: Coordinator, tmp_path: Path) -> None:
        self.node = Node(gossip_period=0.2)
        self.model = _model(seed)
        self.opt = _optimizer(kind, self.node, self.model)
        self.said: list[str] = []
        self.reports: list[Any] = []
        volunteer = Volunteer(JoinOptions("http://c", "sgj_x", data_dir=tmp_path / str(seed)))
        volunteer._say = self.said.append  # type: ignore[method-assign]
        answer = SimpleNamespace(
            peer_id=self.node.peer_id, peer_token="sgp_x", run_id="r", config={}
        )
        session = SimpleNamespace(submit_report=self.reports.append, coordinator_reachable=True)
        # the metric: a figure of the model it is given, parameters and statistics both
        task = SimpleNamespace(
            name="t",
            evaluate=lambda m, c: float(m[0].weight.detach().sum() + m[1].running_mean.sum()),
        )
        config = SimpleNamespace(checkpoint_every=1, recompute_statistics=0)
        self.trainer = Trainer(
            volunteer, client, answer, session, task, config, self.model, self.opt
        )
        g = torch.Generator().manual_seed(100 + seed)
        for _ in range(STEPS):
            x = torch.randn(8, 4, generator=g)
            loss = torch.nn.functional.mse_loss(self.model(x), x.sum(1, keepdim=True).sin())
            loss.backward()
            self.opt.step(batch_size=8)
            self.opt.zero_grad()

    def close(self) -> None:
        self.trainer.close()
        self.opt.shutdown()
        self.node.shutdown()


def _final(epoch: int, peer_id: str) -> CheckpointPublic:
    return CheckpointPublic(
        epoch=epoch, size=1, sha256="0" * 64, created_at=datetime.now(UTC), peer_id=peer_id
    )


def _floats(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v for k, v in state.items() if v.is_floating_point()}


def _equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    a, b = _floats(a), _floats(b)
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("kind", ["collaborative", "diloco"])
def test_a_volunteer_apart_from_the_final_checkpoint_takes_it(kind: str, tmp_path: Path) -> None:
    client = Coordinator()
    uploader = Peer(kind, 0, client, tmp_path)
    apart = Peer(kind, 1, client, tmp_path)
    try:
        epoch = uploader.opt.local_epoch
        assert epoch >= 1 and apart.opt.local_epoch == epoch
        uploader.trainer._maybe_upload()
        assert uploader.trainer.upload is not None
        uploader.trainer.upload.result(timeout=scaled(30))
        ((_, data),) = client.uploads
        checkpoint = torch.load(io.BytesIO(data), weights_only=True)
        assert not _equal(apart.trainer._swarm_state(), checkpoint["model"])

        # the uploader holds it: nothing to take, nothing said
        uploader.trainer._take_final_checkpoint(_final(epoch, uploader.node.peer_id))
        assert uploader.said == []

        apart.trainer._take_final_checkpoint(_final(epoch, uploader.node.peer_id))
        assert _equal(apart.trainer._swarm_state(), checkpoint["model"])
        assert apart.opt.local_epoch == epoch
        assert apart.trainer.eval_metric == checkpoint["metric"]
        assert apart.reports and apart.reports[-1]["eval_metric"] == checkpoint["metric"]
        assert any("differed from the run's final checkpoint" in line for line in apart.said)
        apart.trainer.save_final(tmp_path / "final.pt")
        saved = torch.load(tmp_path / "final.pt", weights_only=True)
        assert _equal(saved["model"], checkpoint["model"]) and saved["epoch"] == epoch

        # once it holds the checkpoint's model, taking it again changes and says nothing
        said = len(apart.said)
        apart.trainer._take_final_checkpoint(_final(epoch, uploader.node.peer_id))
        assert len(apart.said) == said
    finally:
        apart.close()
        uploader.close()


def test_a_final_checkpoint_of_another_model_changes_nothing(tmp_path: Path) -> None:
    client = Coordinator()
    peer = Peer("collaborative", 0, client, tmp_path)
    try:
        before = peer.trainer._swarm_state()
        other = {"model": torch.nn.Linear(3, 3).state_dict(), "optimizer": {}, "epoch": 9}
        buffer = io.BytesIO()
        torch.save(other, buffer)
        client.served = buffer.getvalue()
        peer.trainer._take_final_checkpoint(_final(1, "someone-else"))
        assert _equal(peer.trainer._swarm_state(), before)
        assert peer.said == []
        client.served = b"not a checkpoint"
        peer.trainer._take_final_checkpoint(_final(1, "someone-else"))
        assert _equal(peer.trainer._swarm_state(), before)
    finally:
        peer.close()


def test_a_volunteer_that_learns_the_run_finished_leaves_with_its_final_checkpoint(
    tmp_path: Path,
) -> None:
    """The run finished before this peer looked for its last epoch's checkpoint (the
    coordinator ends a run once that checkpoint is in): it still leaves with the run's
    model, not its own side's; a checkpoint older than its model is left alone."""
    client = Coordinator()
    uploader = Peer("diloco", 0, client, tmp_path)
    apart = Peer("diloco", 1, client, tmp_path)
    try:
        client.uploader = uploader.node.peer_id
        apart.trainer._take_final_model()  # no checkpoint yet: nothing to take
        assert apart.said == []
        uploader.trainer._maybe_upload()
        assert uploader.trainer.upload is not None
        uploader.trainer.upload.result(timeout=scaled(30))
        ((epoch, data),) = client.uploads
        checkpoint = torch.load(io.BytesIO(data), weights_only=True)
        assert apart.opt.local_epoch == epoch
        assert not _equal(apart.trainer._swarm_state(), checkpoint["model"])
        apart.trainer._take_final_model()
        assert _equal(apart.trainer._swarm_state(), checkpoint["model"])
        assert any("differed from the run's final checkpoint" in line for line in apart.said)
        # a checkpoint behind this peer's model stays on the coordinator
        asked = client.downloads
        client.uploads = [(epoch - 1, client.uploads[0][1])]
        apart.trainer._take_final_model()
        assert client.downloads == asked
    finally:
        apart.close()
        uploader.close()
