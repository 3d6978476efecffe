"""A built-in task: a byte-level language model of the text of ``pydoc_data/topics.py``.

Needs no download: the text is a module of Python's standard library (about 750 KB of the
language reference's prose and code, as Python source). Bytes are the tokens (vocabulary
256). The last ``heldout_fraction`` of the file is held out: :meth:`CharLMTask.evaluate` is
the mean cross-entropy, in nats per byte, of the model on fixed windows covering it (an
untrained model scores about ln 256 ≈ 5.55; lower is better).

The model is a small decoder-only transformer (GPT-2's layout, as in nanoGPT: pre-norm
blocks of causal self-attention and an MLP, learned positions, the output layer tied to the
byte embedding), written out plainly: with the defaults (2 layers, width 128, 4 heads,
context 64) it has about 0.43 M parameters and learns on a CPU in minutes.
"""

from __future__ import annotations

import importlib.util
import math
from collections.abc import Iterator
from pathlib import Path
from types import MappingProxyType

import torch
from torch import nn
from torch.nn import functional as F

from peer.formats.open_types import ConfigValues
from peer.tasks.base import Task, TaskError, TrainingConfig, peer_seed

__all__ = ["CharLM", "CharLMTask", "load_text"]

VOCAB = 256  # bytes
TEXT_MODULE = "pydoc_data.topics"


def load_text() -> bytes:
    """The source bytes of :data:`TEXT_MODULE` (read, not imported)."""
    spec = importlib.util.find_spec(TEXT_MODULE)
    origin = spec.origin if spec is not None else None
    if origin is None or not origin.endswith(".py"):
        raise TaskError(f"charlm needs the source of {TEXT_MODULE}, which this Python lacks")
    return Path(origin).read_bytes()


class CausalSelfAttention(nn.Module):
    """Multi-head self-attention where position t attends to positions <= t."""

    mask: torch.Tensor  # a buffer, registered in __init__

    def __init__(self, d_model: int, n_heads: int, context: int) -> None:
        super().__init__()
        self.n_heads = n_heads
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        # [context, context], True where attending is allowed (on and below the diagonal);
        # not persistent: checkpoints and averaging carry parameters only
        mask = torch.tril(torch.ones(context, context, dtype=torch.bool))
        self.register_buffer("mask", mask, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape  # [batch, time, d_model]
        h = self.n_heads
        q, k, v = self.qkv(x).split(d, dim=2)  # each [b, t, d]
        # [b, t, d] -> [b, h, t, d/h]: each head attends on its own slice of the width
        q, k, v = (z.view(b, t, h, d // h).transpose(1, 2) for z in (q, k, v))
        scores = q @ k.transpose(-2, -1) / math.sqrt(d // h)  # [b, h, t, t]
        scores = scores.masked_fill(~self.mask[:t, :t], float("-inf"))
        y = scores.softmax(dim=-1) @ v  # [b, h, t, d/h]
        y = y.transpose(1, 2).reshape(b, t, d)  # heads side by side again: [b, t, d]
        out: torch.Tensor = self.proj(y)  # [b, t, d] (a module's call is untyped)
        return out


class Block(nn.Module):
    """Pre-norm transformer block: x + attention(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, d_model: int, n_heads: int, context: int) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(d_model)
        self.attention = CausalSelfAttention(d_model, n_heads, context)
        self.norm2 = nn.LayerNorm(d_model)
        self.mlp = nn.Sequential(
            nn.Linear(d_model, 4 * d_model), nn.GELU(), nn.Linear(4 * d_model, d_model)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [b, t, d] -> [b, t, d]
        x = x + self.attention(self.norm1(x))
        out: torch.Tensor = x + self.mlp(self.norm2(x))  # (a module's call is untyped)
        return out


class CharLM(nn.Module):
    """Bytes [b, t] (t <= context) -> logits of the next byte at every position [b, t, 256]."""

    def __init__(self, *, d_model: int, n_layers: int, n_heads: int, context: int) -> None:
        super().__init__()
        if d_model % n_heads:
            raise ValueError("d_model must be a multiple of n_heads")
        self.context = context
        self.embed = nn.Embedding(VOCAB, d_model)  # [256, d]
        self.position = nn.Embedding(context, d_model)  # [context, d]
        self.blocks = nn.ModuleList(Block(d_model, n_heads, context) for _ in range(n_layers))
        self.norm = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, VOCAB, bias=False)
        self.head.weight = self.embed.weight  # tied: a byte's embedding scores it as output
        self.apply(_init_weights)
        for name, p in self.named_parameters():
            if name.endswith("proj.weight") or name.endswith("mlp.2.weight"):
                # residual outputs scaled down with depth (GPT-2)
                nn.init.normal_(p, std=0.02 / math.sqrt(2 * n_layers))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        t = tokens.shape[1]  # tokens: [batch, time]
        if t > self.context:
            raise ValueError(f"sequence of {t} bytes, longer than the context ({self.context})")
        positions = torch.arange(t, device=tokens.device)  # [t]
        x = self.embed(tokens) + self.position(positions)  # [b, t, d]
        for block in self.blocks:
            x = block(x)  # [b, t, d]
        logits: torch.Tensor = self.head(self.norm(x))  # [b, t, 256]
        return logits


def _init_weights(module: nn.Module) -> None:
    if isinstance(module, nn.Linear):
        nn.init.normal_(module.weight, std=0.02)
        if module.bias is not None:
            nn.init.zeros_(module.bias)
    elif isinstance(module, nn.Embedding):
        nn.init.normal_(module.weight, std=0.02)


class CharLMTask(Task[torch.Tensor]):
    """Next-byte prediction on ``pydoc_data/topics.py``; metric: held-out loss in nats.

    A batch is a tensor [batch_size, context + 1] of byte windows taken at random offsets
    of the training part (offsets drawn from ``(seed, peer_id)``); the model reads the first
    ``context`` bytes and predicts the last ``context``.

    Defaults: a swarm step on 256 windows (16384 predicted bytes) with AdamW at lr 0.001.
    Measured in one process on one CPU thread (~220 windows/s): the held-out loss goes from
    5.13 to 2.0 nats in 40 steps (about 45 s) and 1.77 in 60. A smaller step learns more
    per sample (128 windows: 1.82 after 60 steps, half the samples) but makes a swarm pay
    its two rounds per epoch twice as often; a larger lr (0.003) stalls on a plateau near
    2.65 for 40 steps. Matchmaking waits 0.5 s, enough on loopback or a LAN; over the
    Internet raise it (``--config matchmaking_time=3``).
    """

    name = "charlm"
    metric_name = "held-out loss"
    higher_is_better = False
    defaults: ConfigValues = MappingProxyType(
        {
            "target_batch_size": 256,
            "batch_size": 32,
            "optimizer": "adamw",
            "lr": 1e-3,
            "weight_decay": 0.01,
            "epochs": None,
            "checkpoint_every": 20,
            "matchmaking_time": 0.5,
            "averaging_timeout": 30.0,
            # the task's own parameters
            "d_model": 128,
            "n_layers": 2,
            "n_heads": 4,
            "context": 64,
            "heldout_fraction": 0.05,
            "eval_windows": 256,  # held-out windows evaluate() scores, spread over the part
        }
    )

    def __init__(self) -> None:
        self._tokens: torch.Tensor | None = None

    def check_params(self, params: ConfigValues) -> None:
        for key in ("d_model", "n_layers", "n_heads", "context", "eval_windows"):
            if params[key] < 1:
                raise ValueError(f"{key}: must be at least 1, got {params[key]}")
        if params["d_model"] % params["n_heads"]:
            raise ValueError(
                f"d_model: must be a multiple of n_heads ({params['n_heads']}), "
                f"got {params['d_model']}"
            )
        if not 0.0 < params["heldout_fraction"] < 0.5:
            raise ValueError(
                f"heldout_fraction: must be in (0, 0.5), got {params['heldout_fraction']}"
            )

    # ---------------------------------------------------------------------- data

    def tokens(self) -> torch.Tensor:
        """The whole text as int64 byte values [n] (read once per task object)."""
        if self._tokens is None:
            self._tokens = torch.frombuffer(bytearray(load_text()), dtype=torch.uint8).long()
        return self._tokens

    def split(self, config: TrainingConfig) -> tuple[torch.Tensor, torch.Tensor]:
        """(training part, held-out part): the text cut ``heldout_fraction`` before its end."""
        tokens = self.tokens()
        cut = len(tokens) - round(len(tokens) * float(config.params["heldout_fraction"]))
        train, heldout = tokens[:cut], tokens[cut:]
        if len(heldout) < config.params["context"] + 1:
            raise ValueError("heldout_fraction: the held-out part is shorter than one window")
        return train, heldout

    def eval_windows(self, config: TrainingConfig) -> torch.Tensor:
        """The windows :meth:`evaluate` scores, [k, context + 1]: consecutive windows of the
        held-out part (each overlapping the next by one byte, so every byte after the first
        is predicted once), evenly thinned to at most ``eval_windows``."""
        _, heldout = self.split(config)
        context = int(config.params["context"])
        starts = torch.arange(0, len(heldout) - context, context)  # [all windows]
        keep = min(len(starts), int(config.params["eval_windows"]))
        starts = starts[torch.linspace(0, len(starts) - 1, keep).round().long()]  # [keep]
        return heldout[starts[:, None] + torch.arange(context + 1)]  # [keep, context + 1]

    # ---------------------------------------------------------------------- Task

    def build_model(self, config: TrainingConfig) -> torch.nn.Module:
        p = config.params
        with torch.random.fork_rng(devices=[]):  # the caller's random stream is left alone
            torch.manual_seed(config.seed)
            return CharLM(
                d_model=int(p["d_model"]),
                n_layers=int(p["n_layers"]),
                n_heads=int(p["n_heads"]),
                context=int(p["context"]),
            )

    def train_batches(self, config: TrainingConfig, peer_id: str) -> Iterator[torch.Tensor]:
        train, _ = self.split(config)
        span = torch.arange(int(config.params["context"]) + 1)  # [context + 1]
        generator = torch.Generator().manual_seed(peer_seed(config.seed, peer_id))
        return _random_windows(train, span, config.batch_size, generator)

    def loss(self, model: torch.nn.Module, batch: torch.Tensor) -> torch.Tensor:
        batch = batch.to(next(model.parameters()).device)  # [b, context + 1]
        logits = model(batch[:, :-1])  # [b, context, 256]
        return F.cross_entropy(logits.reshape(-1, VOCAB), batch[:, 1:].reshape(-1))

    def batch_size(self, batch: torch.Tensor) -> int:
        return int(batch.shape[0])

    def evaluate(self, model: torch.nn.Module, config: TrainingConfig) -> float:
        windows = self.eval_windows(config)  # [k, context + 1]
        was_training = model.training
        model.eval()
        total = 0.0
        try:
            with torch.no_grad():
                for chunk in torch.split(windows, 64):  # typed, unlike Tensor.split
                    total += float(self.loss(model, chunk)) * len(chunk)
        finally:
            model.train(was_training)
        return total / len(windows)


def _random_windows(
    tokens: torch.Tensor, span: torch.Tensor, batch_size: int, generator: torch.Generator
) -> Iterator[torch.Tensor]:
    """Forever: [batch_size, len(span)] windows of ``tokens`` at offsets from ``generator``."""
    high = len(tokens) - len(span) + 1
    while True:
        starts = torch.randint(0, high, (batch_size,), generator=generator)  # [batch_size]
        yield tokens[starts[:, None] + span]  # [batch_size, len(span)]
