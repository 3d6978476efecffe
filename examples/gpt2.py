"""A small GPT-2 trained by a swarm: a task file for ``swarmgrad``.

    swarmgrad demo --task-file examples/gpt2.py --peers 3 --epochs 3
    swarmgrad runs create gpt2 --task-file examples/gpt2.py:task \\
        --config epochs=200 --config lr_schedule=cosine --config warmup_epochs=10

The model is GPT-2's layout written in plain torch: learned token and position embeddings,
pre-norm blocks of causal self-attention and a GELU MLP, a final layer norm, and an output
layer whose weight *is* the token embedding (tied: one parameter, listed once by
``model.parameters()``, so the swarm averages it once; the state dict names it twice,
``wte.weight`` and ``lm_head.weight``, and ``load_state_dict`` keeps the two one tensor).

The text needs no download: the source files of a few modules of Python's standard library
(:data:`TEXT_MODULES`), read as bytes; each byte is a token (vocabulary 256). Volunteers
on different Python versions read slightly different text: fine for training, but compare
held-out figures across one version. The last ``heldout_fraction`` is held out;
:meth:`GPT2Task.evaluate` is the mean cross-entropy in nats per byte over fixed windows of
it (an untrained model scores about ln 256 = 5.55).

The defaults fit a laptop: 2 layers of width 64 (about 0.1 M parameters), windows of 64
bytes, a swarm step of 64 windows, AdamW with gradient clipping at 1.0 as GPT-2 trains.
"""

from __future__ import annotations

import importlib.util
import math
from collections.abc import Iterator, Mapping
from pathlib import Path
from types import MappingProxyType
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from peer.tasks.base import Task, TrainingConfig, peer_seed

VOCAB = 256  # bytes
TEXT_MODULES = ("textwrap", "argparse", "difflib", "string", "fractions")


def load_text() -> bytes:
    """The source bytes of :data:`TEXT_MODULES`, one after the other."""
    parts = []
    for name in TEXT_MODULES:
        spec = importlib.util.find_spec(name)
        origin = spec.origin if spec is not None else None
        if origin is None or not origin.endswith(".py"):
            raise ValueError(
                f"the gpt2 example reads the source of {name}, which this Python lacks"
            )
        parts.append(Path(origin).read_bytes())
    return b"\n".join(parts)


class Block(nn.Module):
    """Pre-norm block: x + attention(ln(x)), then x + mlp(ln(x)); [b, t, d] -> [b, t, d]."""

    def __init__(self, d_model: int, n_heads: int) -> None:
        super().__init__()
        self.n_heads = n_heads
        self.ln_1 = nn.LayerNorm(d_model)
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.ln_2 = nn.LayerNorm(d_model)
        self.mlp = nn.Sequential(
            nn.Linear(d_model, 4 * d_model), nn.GELU(), nn.Linear(4 * d_model, d_model)
        )

    def attention(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        # [b, t, 3d] -> three [b, h, t, d/h]: each head attends on its own slice of the width
        q, k, v = (
            z.view(b, t, self.n_heads, d // self.n_heads).transpose(1, 2)
            for z in self.qkv(x).split(d, dim=2)
        )
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # [b, h, t, d/h]
        return self.proj(y.transpose(1, 2).reshape(b, t, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT2(nn.Module):
    """Bytes [b, t] (t <= context) -> logits of the next byte at each position [b, t, 256]."""

    def __init__(self, *, d_model: int, n_layers: int, n_heads: int, context: int) -> None:
        super().__init__()
        self.context = context
        self.wte = nn.Embedding(VOCAB, d_model)  # token embedding [256, d]
        self.wpe = nn.Embedding(context, d_model)  # position embedding [context, d]
        self.blocks = nn.ModuleList(Block(d_model, n_heads) for _ in range(n_layers))
        self.ln_f = nn.LayerNorm(d_model)
        self.lm_head = nn.Linear(d_model, VOCAB, bias=False)
        self.lm_head.weight = self.wte.weight  # tied (Press & Wolf, 2017)
        for module in self.modules():
            if isinstance(module, nn.Linear | nn.Embedding):
                nn.init.normal_(module.weight, std=0.02)
            if isinstance(module, nn.Linear) and module.bias is not None:
                nn.init.zeros_(module.bias)
        for name, p in self.named_parameters():
            if name.endswith("proj.weight") or name.endswith("mlp.2.weight"):
                # residual outputs scaled down with depth, as GPT-2 does
                nn.init.normal_(p, std=0.02 / math.sqrt(2 * n_layers))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        t = tokens.shape[1]
        if t > self.context:
            raise ValueError(f"{t} tokens, more than the context ({self.context})")
        x = self.wte(tokens) + self.wpe(torch.arange(t, device=tokens.device))  # [b, t, d]
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))  # [b, t, 256]


class GPT2Task(Task):
    """Next-byte prediction on the standard library's source; metric: held-out loss.

    A batch is [batch_size, context + 1] windows of the training part at random offsets
    drawn from ``(seed, peer_id)``: each volunteer its own order."""

    name = "gpt2"
    metric_name = "held-out loss"
    higher_is_better = False
    defaults: Mapping[str, Any] = MappingProxyType(
        {
            "target_batch_size": 64,
            "batch_size": 16,
            "optimizer": "adamw",
            "lr": 3e-3,
            "weight_decay": 0.01,
            "max_grad_norm": 1.0,
            "checkpoint_every": 5,
            "matchmaking_time": 0.5,
            # the task's own parameters
            "d_model": 64,
            "n_layers": 2,
            "n_heads": 4,
            "context": 64,
            "heldout_fraction": 0.05,
            "eval_windows": 64,
        }
    )

    def __init__(self) -> None:
        self._tokens: torch.Tensor | None = None

    def check_params(self, params: Mapping[str, Any]) -> None:
        for key in ("d_model", "n_layers", "n_heads", "context", "eval_windows"):
            if params[key] < 1:
                raise ValueError(f"{key}: must be at least 1, got {params[key]}")
        if params["d_model"] % params["n_heads"]:
            raise ValueError(f"d_model: a multiple of n_heads ({params['n_heads']})")
        if not 0.0 < params["heldout_fraction"] < 0.5:
            raise ValueError(f"heldout_fraction: in (0, 0.5), got {params['heldout_fraction']}")

    def split(self, config: TrainingConfig) -> tuple[torch.Tensor, torch.Tensor]:
        """(training part, held-out part) of the text as int64 bytes."""
        if self._tokens is None:  # read on first use: naming the task stays cheap
            self._tokens = torch.frombuffer(bytearray(load_text()), dtype=torch.uint8).long()
        cut = len(self._tokens) - round(len(self._tokens) * config.params["heldout_fraction"])
        return self._tokens[:cut], self._tokens[cut:]

    def build_model(self, config: TrainingConfig) -> nn.Module:
        p = config.params
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(config.seed)
            return GPT2(
                d_model=p["d_model"], n_layers=p["n_layers"], n_heads=p["n_heads"],
                context=p["context"],
            )  # fmt: skip

    def train_batches(self, config: TrainingConfig, peer_id: str) -> Iterator[torch.Tensor]:
        train, _ = self.split(config)
        span = torch.arange(config.params["context"] + 1)  # [context + 1]
        generator = torch.Generator().manual_seed(peer_seed(config.seed, peer_id))
        while True:
            starts = torch.randint(
                0, len(train) - len(span), (config.batch_size,), generator=generator
            )
            yield train[starts[:, None] + span]  # [batch_size, context + 1]

    def loss(self, model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
        batch = batch.to(next(model.parameters()).device)
        logits = model(batch[:, :-1])  # [b, context, 256]
        return F.cross_entropy(logits.reshape(-1, VOCAB).float(), batch[:, 1:].reshape(-1))

    def batch_size(self, batch: torch.Tensor) -> int:
        return int(batch.shape[0])

    def evaluate(self, model: nn.Module, config: TrainingConfig) -> float:
        _, heldout = self.split(config)
        context = config.params["context"]
        starts = torch.arange(0, len(heldout) - context - 1, context)
        keep = min(len(starts), config.params["eval_windows"])
        starts = starts[torch.linspace(0, len(starts) - 1, keep).round().long()]
        windows = heldout[starts[:, None] + torch.arange(context + 1)]  # [keep, context + 1]
        was_training = model.training
        model.eval()
        try:
            with torch.no_grad():
                return float(self.loss(model, windows))
        finally:
            model.train(was_training)


def task() -> GPT2Task:
    return GPT2Task()
