"""One machine of the two-process Lightning test (not collected by pytest): trains a tiny
LightningModule with SwarmgradStrategy until the swarm reaches ``--epochs`` swarm epochs,
then saves its parameters and the epochs it saw."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

import lightning as L
from lightning.pytorch.demos.boring_classes import BoringModel, RandomDataset
from torch.utils.data import DataLoader

from peer.integrations.lightning import SwarmgradStrategy
from swarmlab.node_process import wait_until


class Model(BoringModel):
    def __init__(self, epochs: int) -> None:
        super().__init__()
        self.epochs = epochs
        self.seen: list[int] = []

    def on_train_batch_end(self, outputs, batch, batch_idx) -> None:
        opt = self.trainer.strategy.optimizer
        # a peer alone steps on its own: start together (4 samples are not an epoch yet)
        if batch_idx == 0 and not wait_until(lambda: opt.tracker.others_reporting() >= 1, 60, 0.05):
            raise RuntimeError("the other machine's optimizer did not report")
        self.seen.append(opt.local_epoch)
        if opt.local_epoch >= self.epochs:
            self.trainer.should_stop = True

    def train_dataloader(self) -> DataLoader:
        return DataLoader(RandomDataset(32, 4096), batch_size=4)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--initial-peer", default=None)
    parser.add_argument("--peers", type=int, default=2)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    torch.set_num_threads(1)
    L.seed_everything(0)
    model = Model(args.epochs)  # the same initial weights on every machine
    torch.manual_seed(100 + args.rank)  # different data
    strategy = SwarmgradStrategy(
        target_batch_size=16,
        run_id="lightning-test",
        matchmaking_time=0.5,
        averaging_timeout=30.0,
        host="127.0.0.1",
        initial_peers=[args.initial_peer] if args.initial_peer else None,
    )
    print(json.dumps({"addresses": strategy.node.visible_addresses}), flush=True)
    if not wait_until(lambda: len(strategy.node.members()) >= args.peers, 60, 0.05):
        raise SystemExit("the other machine did not show up")
    trainer = L.Trainer(
        strategy=strategy,
        max_epochs=1,
        limit_val_batches=0,
        enable_checkpointing=False,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(model)
    torch.save(
        {"params": [p.detach().clone() for p in model.parameters()], "seen": model.seen},
        args.out,
    )


if __name__ == "__main__":
    main()
