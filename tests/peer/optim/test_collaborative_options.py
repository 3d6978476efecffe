"""Collaborative optimizer options, with two peers in one process over loopback WebSockets."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from functools import partial

import pytest
import torch

from peer import Node
from peer.optim.collaborative import Optimizer
from tests.conftest import scaled


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))


def _batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * step + rank)
    x = torch.randn(4, 4, generator=g)
    return x, x.sum(dim=1, keepdim=True).cos()


@pytest.fixture
def nodes() -> Iterator[list[Node]]:
    a = Node(gossip_period=0.2)
    b = Node(a.visible_addresses, gossip_period=0.2)
    yield [a, b]
    b.shutdown()
    a.shutdown()


def test_invalid_combinations_raise_with_the_reason(nodes: list[Node]) -> None:
    model = _model()
    sgd = partial(torch.optim.SGD, lr=0.1)
    common = dict(
        node=nodes[0], run_id="bad", target_batch_size=8, optimizer=sgd, params=model.parameters()
    )
    for kwargs, reason in (
        ({"delay_grad_averaging": True}, "not implemented yet"),
        (
            {"use_local_updates": True, "reuse_grad_buffers": True, "batch_size_per_step": 4},
            "no gradient accumulation",
        ),
        ({"reuse_grad_buffers": True}, "fixed batch_size_per_step"),
        ({"target_batch_size": 0}, "positive integer"),
        ({"run_id": ""}, "non-empty"),
        ({"auxiliary": True, "client_mode": True}, "cannot be in client mode"),
        ({"delay_optimizer_step": True}, "not implemented yet"),
        ({"delay_state_averaging": True}, "not implemented yet"),
    ):
        with pytest.raises(ValueError, match=reason):
            Optimizer(**{**common, **kwargs})
    with pytest.raises(ValueError, match="only for an optimizer factory"):
        Optimizer(**{**common, "optimizer": torch.optim.SGD(model.parameters(), lr=0.1)})


def _train(
    nodes: list[Node], epochs: int, *, scaler: bool = False, **options: object
) -> list[list[torch.Tensor]]:
    models = [_model(), _model()]
    opts = [
        Optimizer(
            node=node,
            run_id="options",
            target_batch_size=8,
            batch_size_per_step=4,
            optimizer=partial(torch.optim.SGD, lr=0.1, momentum=0.5),
            params=model.parameters(),
            matchmaking_time=1.0,
            averaging_timeout=scaled(20),
            **options,
        )
        for node, model in zip(nodes, models, strict=True)
    ]
    errors: list[BaseException] = []
    scalers = [torch.amp.GradScaler("cpu", init_scale=2.0**12) for _ in range(2)]

    def run(rank: int) -> None:
        model, opt = models[rank], opts[rank]
        deadline = time.monotonic() + scaled(120)
        try:
            while opt.local_epoch < epochs and time.monotonic() < deadline:
                epoch = opt.local_epoch
                x, y = _batch(rank, epoch)
                loss = torch.nn.functional.mse_loss(model(x), y)
                if scaler:
                    grad_scaler = scalers[rank]
                    grad_scaler.scale(loss).backward()
                    opt.step(grad_scaler=grad_scaler)
                else:
                    loss.backward()
                    opt.step()
                if not options.get("reuse_grad_buffers"):
                    opt.zero_grad()
                while opt.local_epoch == epoch and time.monotonic() < deadline:
                    opt.step(batch_size=0)
                    time.sleep(0.05)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for opt in opts:
        opt.shutdown()
    assert not errors, errors
    assert [opt.local_epoch for opt in opts] == [epochs, epochs]
    return [[p.detach().clone() for p in m.parameters()] for m in models]


def test_reuse_grad_buffers_gives_the_same_training(nodes: list[Node]) -> None:
    plain = _train(nodes, 3)
    reused = _train(nodes, 3, reuse_grad_buffers=True)
    for a, b in zip(plain[0], reused[0], strict=True):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=0)
    for a, b in zip(reused[0], reused[1], strict=True):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=0)


def test_local_updates_keep_peers_in_step(nodes: list[Node]) -> None:
    """use_local_updates: each peer steps on its own batches, and parameters are averaged
    every epoch, so both peers end each epoch on the same model."""
    start = [p.detach().clone() for p in _model().parameters()]
    final = _train(nodes, 3, use_local_updates=True)
    for a, b in zip(final[0], final[1], strict=True):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=0)
    assert any(not torch.equal(a, b) for a, b in zip(final[0], start, strict=True)), (
        "training moved the model"
    )


def test_grad_scaler_unscales_before_accumulating(nodes: list[Node]) -> None:
    plain = _train(nodes, 2)
    scaled_run = _train(nodes, 2, scaler=True)
    for a, b in zip(plain[0], scaled_run[0], strict=True):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=0)


def test_grad_scaler_overflow_drops_the_batch(nodes: list[Node]) -> None:
    model = _model()
    opt = Optimizer(
        node=nodes[0],
        run_id="overflow",
        target_batch_size=1000,
        batch_size_per_step=4,
        optimizer=partial(torch.optim.SGD, lr=0.1),
        params=model.parameters(),
    )
    try:
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**12)
        x, y = _batch(0, 0)
        scaler.scale(torch.nn.functional.mse_loss(model(x), y) * float("inf")).backward()
        opt.step(grad_scaler=scaler)
        assert opt._samples == 0, "an overflowed batch adds no samples"
        assert scaler.get_scale() < 2.0**12, "the scaler backs off after an overflow"
        assert all(p.grad is None for p in model.parameters())
        scaler.scale(torch.nn.functional.mse_loss(model(x), y)).backward()
        opt.step(grad_scaler=scaler)
        assert opt._samples == 4
        assert all(torch.isfinite(g).all() for g in opt._grads)
    finally:
        opt.shutdown()
