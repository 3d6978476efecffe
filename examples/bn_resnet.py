"""A small ResNet with BatchNorm trained by a swarm: a task file for ``swarmgrad``.

    swarmgrad demo --task-file examples/bn_resnet.py --peers 3 --epochs 3
    swarmgrad demo --task-file examples/bn_resnet.py --algorithm diloco \\
        --config recompute_statistics=10

The data is scikit-learn's bundled digits (1,797 images of 8x8 pixels, 10 classes; no
download). The split into training and held-out images depends on the run's ``seed`` only,
so every volunteer holds out the same images; :meth:`ResNetTask.evaluate` is the accuracy on
them, in eval mode (BatchNorm normalising with its running statistics).

The model: a 3x3 convolution stem, two residual stages of basic blocks (two 3x3 convolutions,
each followed by BatchNorm; the second stage halves the resolution and doubles the width,
its shortcut a 1x1 convolution with BatchNorm), global average pooling and a linear layer:
He et al., "Deep Residual Learning for Image Recognition", 2016, at a digits' scale.

Its BatchNorm running statistics are buffers: by default the swarm averages them with the
parameters and hands them to newcomers, so every volunteer evaluates (and the checkpoint
holds) the same statistics; ``num_batches_tracked`` stays an integer. With DiLoCo,
``recompute_statistics=N`` recomputes the statistics of the uploaded model at its own
parameters over N batches.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from types import MappingProxyType
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from peer.tasks.base import Task, TrainingConfig, peer_seed

NUM_CLASSES = 10


def conv_bn(c_in: int, c_out: int, kernel: int, stride: int = 1) -> nn.Sequential:
    """A convolution without bias (BatchNorm's shift replaces it), then BatchNorm."""
    return nn.Sequential(
        nn.Conv2d(c_in, c_out, kernel, stride=stride, padding=kernel // 2, bias=False),
        nn.BatchNorm2d(c_out),
    )


class BasicBlock(nn.Module):
    """relu(x + bn(conv(relu(bn(conv(x)))))); a strided block projects its shortcut."""

    def __init__(self, c_in: int, c_out: int, stride: int) -> None:
        super().__init__()
        self.conv1 = conv_bn(c_in, c_out, 3, stride)
        self.conv2 = conv_bn(c_out, c_out, 3)
        self.shortcut = (
            conv_bn(c_in, c_out, 1, stride) if stride != 1 or c_in != c_out else nn.Identity()
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [b, c_in, h, w] -> [b, c_out, h/s, w/s]
        return F.relu(self.shortcut(x) + self.conv2(F.relu(self.conv1(x))))


class ResNet(nn.Module):
    """Images [b, 1, 8, 8] -> class logits [b, 10]."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.stem = conv_bn(1, width, 3)  # [b, w, 8, 8]
        self.stage1 = BasicBlock(width, width, 1)  # [b, w, 8, 8]
        self.stage2 = BasicBlock(width, 2 * width, 2)  # [b, 2w, 4, 4]
        self.fc = nn.Linear(2 * width, NUM_CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stage2(self.stage1(F.relu(self.stem(x))))
        return self.fc(x.mean(dim=(2, 3)))  # global average pooling: [b, 2w] -> [b, 10]


class ResNetTask(Task):
    """Digits classification with a small ResNet; metric: held-out accuracy."""

    name = "bn_resnet"
    metric_name = "accuracy"
    higher_is_better = True
    defaults: Mapping[str, Any] = MappingProxyType(
        {
            "target_batch_size": 96,
            "batch_size": 32,
            "optimizer": "adam",
            "lr": 0.01,
            "checkpoint_every": 5,
            "matchmaking_time": 0.5,
            # the task's own parameters
            "width": 8,
            "test_fraction": 0.2,
        }
    )

    def __init__(self) -> None:
        self._data: tuple[torch.Tensor, torch.Tensor] | None = None

    def check_params(self, params: Mapping[str, Any]) -> None:
        if params["width"] < 1:
            raise ValueError(f"width: must be at least 1, got {params['width']}")
        if not 0.0 < params["test_fraction"] < 1.0:
            raise ValueError(f"test_fraction: in (0, 1), got {params['test_fraction']}")

    def split(self, config: TrainingConfig) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(images [n, 1, 8, 8] in [0, 1], labels [n], held-out mask [n]) by the seed."""
        if self._data is None:  # loaded on first use: naming the task stays cheap
            from sklearn.datasets import load_digits

            digits = load_digits()
            images = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0
            self._data = images, torch.tensor(digits.target, dtype=torch.int64)
        images, labels = self._data
        order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(config.seed))
        heldout = torch.zeros(len(labels), dtype=torch.bool)
        heldout[order[: round(len(labels) * config.params["test_fraction"])]] = True
        return images, labels, heldout

    def build_model(self, config: TrainingConfig) -> nn.Module:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(config.seed)
            return ResNet(config.params["width"])

    def train_batches(self, config: TrainingConfig, peer_id: str) -> Iterator[Any]:
        images, labels, heldout = self.split(config)
        train = (~heldout).nonzero().squeeze(1)  # [n_train]
        generator = torch.Generator().manual_seed(peer_seed(config.seed, peer_id))
        while True:
            pick = train[torch.randint(0, len(train), (config.batch_size,), generator=generator)]
            yield images[pick], labels[pick]

    def loss(self, model: nn.Module, batch: Any) -> torch.Tensor:
        device = next(model.parameters()).device
        x, y = (t.to(device) for t in batch)
        return F.cross_entropy(model(x).float(), y)

    def batch_size(self, batch: Any) -> int:
        return int(batch[1].shape[0])

    def evaluate(self, model: nn.Module, config: TrainingConfig) -> float:
        images, labels, heldout = self.split(config)
        device = next(model.parameters()).device
        was_training = model.training
        model.eval()
        try:
            with torch.no_grad():
                predicted = model(images[heldout].to(device)).argmax(dim=1).cpu()
        finally:
            model.train(was_training)
        return float((predicted == labels[heldout]).float().mean())


def task() -> ResNetTask:
    return ResNetTask()
