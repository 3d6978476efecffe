"""Collaborative optimizer options, with two peers in one process over loopback WebSockets.

Each peer computes one batch per epoch, then takes part with ``step(batch_size=0)`` until the
epoch advances. So with a delayed optimizer step the next batch's gradients are computed
before the previous update reaches the model — deterministically — and training equals
single-process training with updates one step stale (:func:`_reference`)."""

from __future__ import annotations

import threading
import time
from functools import partial

import pytest
import torch

from peer import Node
from peer.optim.collaborative.optimizer import Optimizer
from peer.optim.collaborative.options import resolve_options
from peer.optim.shared.progress import ProgressReport, ProgressTracker
from swarmlab.node_process import wait_until
from tests.conftest import scaled


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))


def _batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * step + rank)
    x = torch.randn(4, 4, generator=g)
    return x, x.sum(dim=1, keepdim=True).cos()


def test_a_lone_peer_trains_without_waiting_for_a_group(caplog: pytest.LogCaptureFixture) -> None:
    """Alone in the run (no other progress report), a peer skips the rounds (it would only
    wait out ``averaging_timeout`` to step with its own gradients anyway): no round fails,
    and training equals plain local SGD on its batches."""
    model, reference = _model(), _model()
    sgd = partial(torch.optim.SGD, lr=0.1, momentum=0.5)
    local = sgd(reference.parameters())
    with Node(gossip_period=0.2) as node, caplog.at_level("WARNING", logger="peer.optim"):
        opt = Optimizer(
            node=node,
            run_id="alone",
            target_batch_size=4,
            batch_size_per_step=4,
            optimizer=sgd,
            params=model.parameters(),
            average_state_every=1,
            matchmaking_time=0.5,
            averaging_timeout=scaled(3),
        )
        try:
            for epoch in range(3):
                x, y = _batch(0, epoch)
                torch.nn.functional.mse_loss(model(x), y).backward()
                opt.step()
                opt.zero_grad()
                assert opt.local_epoch == epoch + 1
                local.zero_grad()
                torch.nn.functional.mse_loss(reference(x), y).backward()
                local.step()
        finally:
            opt.shutdown()
    assert "failed" not in caplog.text
    for a, b in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=0)


def test_invalid_combinations_raise_with_the_reason(nodes: list[Node]) -> None:
    model = _model()
    sgd = partial(torch.optim.SGD, lr=0.1)
    common = dict(
        node=nodes[0], run_id="bad", target_batch_size=8, optimizer=sgd, params=model.parameters()
    )
    for kwargs, reason in (
        (
            {"delay_grad_averaging": True, "delay_optimizer_step": False},
            "delay_grad_averaging needs delay_optimizer_step",
        ),
        ({"delay_optimizer_step": True, "offload_optimizer": False}, "needs offload_optimizer"),
        (
            {"delay_optimizer_step": True, "delay_state_averaging": False},
            "state averaging follows the optimizer step",
        ),
        (
            {"delay_grad_averaging": True, "reuse_grad_buffers": True, "batch_size_per_step": 4},
            "reuse_grad_buffers cannot be combined with delay_grad_averaging",
        ),
        (
            {"use_local_updates": True, "delay_grad_averaging": True},
            "there is no gradient round to delay",
        ),
        (
            {"use_local_updates": True, "delay_optimizer_step": True},
            "delay_optimizer_step is not supported with it",
        ),
        (
            {"use_local_updates": True, "reuse_grad_buffers": True, "batch_size_per_step": 4},
            "no gradient accumulation",
        ),
        ({"reuse_grad_buffers": True}, "fixed batch_size_per_step"),
        ({"target_batch_size": 0}, "positive integer"),
        ({"run_id": ""}, "non-empty"),
        ({"auxiliary": True, "client_mode": True}, "cannot be in client mode"),
    ):
        with pytest.raises(ValueError, match=reason):
            Optimizer(**{**common, **kwargs})
    prebuilt = {**common, "optimizer": torch.optim.SGD(model.parameters(), lr=0.1), "params": None}
    with pytest.raises(ValueError, match="only for an optimizer factory"):
        Optimizer(**{**prebuilt, "params": model.parameters()})
    for kwargs in ({"offload_optimizer": True}, {"delay_optimizer_step": True}):
        with pytest.raises(ValueError, match="pass optimizer= as a factory"):
            Optimizer(**{**prebuilt, **kwargs})


def _reference(epochs: int, *, stale: bool = False) -> list[torch.Tensor]:
    """One process, one step per epoch on both peers' batches. ``stale``: the gradients of
    epoch k are taken at the parameters from before epoch k-1's update (delayed updates)."""
    model, probe = _model(), _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.5)
    before = [p.detach().clone() for p in model.parameters()]
    for epoch in range(epochs):
        at = before if stale else [p.detach().clone() for p in model.parameters()]
        before = [p.detach().clone() for p in model.parameters()]
        with torch.no_grad():
            for q, value in zip(probe.parameters(), at, strict=True):
                q.copy_(value)
        xs, ys = zip(*(_batch(rank, epoch) for rank in range(2)), strict=True)
        probe.zero_grad()
        torch.nn.functional.mse_loss(probe(torch.cat(xs)), torch.cat(ys)).backward()
        for p, q in zip(model.parameters(), probe.parameters(), strict=True):
            p.grad = q.grad
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


def _train(
    nodes: list[Node],
    epochs: int,
    *,
    scaler: bool = False,
    overlapped: list[int] | None = None,
    **options: object,
) -> list[list[torch.Tensor]]:
    """Train both peers; their final parameters, after any pending update is applied.
    ``overlapped`` (if given) counts the batches a peer accumulated while a background epoch
    was still pending."""
    models = [_model(), _model()]
    opts = [
        Optimizer(
            node=node,
            run_id="options",
            target_batch_size=8,
            batch_size_per_step=4,
            optimizer=partial(torch.optim.SGD, lr=0.1, momentum=0.5),
            params=model.parameters(),
            matchmaking_time=0.5,
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
                if overlapped is not None and opt.pending_update:
                    overlapped.append(rank)
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
    try:
        for opt in opts:
            assert opt.wait_for_pending(timeout=scaled(60))
            assert not opt.pending_update
    finally:
        for opt in opts:
            opt.shutdown()
    assert not errors, errors
    assert [opt.local_epoch for opt in opts] == [epochs, epochs]
    return [[p.detach().clone() for p in m.parameters()] for m in models]


def test_reuse_grad_buffers_gives_the_same_training(nodes: list[Node]) -> None:
    plain = _train(nodes, 3)
    reused = _train(nodes, 3, reuse_grad_buffers=True)
    # 1e-5 as the other exactness checks: rounds leave last-bit differences that momentum
    # carries (seen at 2e-6 with HEAD's code too)
    for a, b in zip(plain[0], reused[0], strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0)
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


@pytest.mark.parametrize("offload", [False, True])
def test_grad_scaler_unscales_before_accumulating(nodes: list[Node], offload: bool) -> None:
    """The model's gradients are unscaled (with offload_optimizer the wrapped optimizer holds
    the host copies, whose .grad the scaler must not touch)."""
    scaled_run = _train(nodes, 2, scaler=True, offload_optimizer=offload)
    for a, b in zip(_reference(2), scaled_run[0], strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0)


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
        assert opt.grads.samples == 0, "an overflowed batch adds no samples"
        assert scaler.get_scale() < 2.0**12, "the scaler backs off after an overflow"
        assert all(p.grad is None for p in model.parameters())
        scaler.scale(torch.nn.functional.mse_loss(model(x), y)).backward()
        opt.step(grad_scaler=scaler)
        assert opt.grads.samples == 4
        assert all(torch.isfinite(g).all() for g in opt.grads.acc)
    finally:
        opt.shutdown()


def test_offload_optimizer_steps_host_copies_and_equals_reference(nodes: list[Node]) -> None:
    model = _model()
    opt = Optimizer(
        node=nodes[0],
        run_id="offload-layout",
        target_batch_size=8,
        optimizer=partial(torch.optim.Adam, lr=0.1),
        params=model.parameters(),
        offload_optimizer=True,
    )
    try:
        offloaded = [p for g in opt.opt.param_groups for p in g["params"]]
        assert all(o is not p for o, p in zip(offloaded, model.parameters(), strict=True))
        assert all(
            o.data_ptr() != p.data_ptr() for o, p in zip(offloaded, model.parameters(), strict=True)
        )
        assert set(opt.opt.state) == set(offloaded), "the optimizer state lives on the copies"
    finally:
        opt.shutdown()
    final = _train(nodes, 3, offload_optimizer=True)
    for peer in final:
        for a, b in zip(_reference(3), peer, strict=True):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=0)


@pytest.mark.parametrize(
    "options",
    [{"delay_optimizer_step": True}, {"delay_grad_averaging": True}],
    ids=["delay_optimizer_step", "delay_grad_averaging"],
)
def test_delayed_updates_equal_training_one_step_stale(
    nodes: list[Node], options: dict[str, bool]
) -> None:
    """Both peers end (after wait_for_pending) on the parameters of single-process training
    whose gradients are one update behind; not on those of synchronous training. With
    delay_grad_averaging the next batch is accumulated while the round is in flight, and no
    gradient is lost or counted twice (else the result would differ)."""
    epochs = 3
    overlapped: list[int] = []
    final = _train(nodes, epochs, overlapped=overlapped, **options)
    stale, synchronous = _reference(epochs, stale=True), _reference(epochs)
    for peer in final:
        for mine, want in zip(peer, stale, strict=True):
            torch.testing.assert_close(mine, want, atol=1e-5, rtol=0)
    assert any((a - b).abs().max() > 1e-4 for a, b in zip(stale, synchronous, strict=True)), (
        "the stale reference must differ from the synchronous one, or the test proves nothing"
    )
    if options.get("delay_grad_averaging"):
        assert overlapped, "some batch was accumulated while its predecessor's round was running"


def test_a_peer_faster_than_averaging_waits_one_epoch_ahead(nodes: list[Node]) -> None:
    """With delays, a peer whose batches take far less than a round (matchmaking alone takes
    a second here) accumulates its share of the next epoch, then waits for the running one:
    epochs stay near the target, not one huge epoch per round (without the wait, the fast
    batches pile up into a couple of epochs)."""
    models = [_model(), _model()]
    opts = [
        Optimizer(
            node=node,
            run_id="ahead",
            target_batch_size=8,
            batch_size_per_step=4,
            optimizer=partial(torch.optim.SGD, lr=0.1),
            params=model.parameters(),
            matchmaking_time=0.5,
            averaging_timeout=scaled(20),
            delay_grad_averaging=True,
            delay_optimizer_step=True,
        )
        for node, model in zip(nodes, models, strict=True)
    ]
    batches = 12
    errors: list[BaseException] = []
    for opt in opts:  # both train from the start: each sees the other before its first batch
        opt.step(batch_size=0)
    assert wait_until(lambda: all(o.global_progress.num_peers == 2 for o in opts), scaled(20))

    def run(rank: int) -> None:
        model, opt = models[rank], opts[rank]
        try:
            for step in range(batches):
                x, y = _batch(rank, step)
                torch.nn.functional.mse_loss(model(x), y).backward()
                opt.step()
                opt.zero_grad()
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    try:
        assert not errors, errors
        # 2 peers x 12 batches x 4 samples = 96 samples = 12 targets; gossip lag may let an
        # epoch take a batch or two more, but never the whole run's worth.
        assert all(opt.local_epoch >= batches // 3 for opt in opts), [o.local_epoch for o in opts]
    finally:
        for opt in opts:
            opt.shutdown()


def test_a_peer_claiming_an_epoch_far_ahead_does_not_stall_the_others(
    nodes: list[Node], caplog: pytest.LogCaptureFixture
) -> None:
    """A third peer reports epoch 10**9 (and keeps its report alive) without training or
    offering a state. Each honest peer finds itself behind, sees no peer offer a state
    newer than its own for a declaration period (2 s here), names the liar and discounts its
    claim, instead of waiting ``load_state_timeout`` for a state that will never come; both
    train on as if the liar were not there."""
    liar = Node(nodes[0].visible_addresses, gossip_period=0.2)
    trackers = [ProgressTracker(n, "options", 8, expiration=60.0) for n in (*nodes, liar)]
    try:
        for tracker, epoch in zip(trackers, (0, 0, 10**9), strict=True):
            peer_id = tracker.node.peer_id
            tracker.report(ProgressReport(peer_id, epoch, 0, 0, time.time(), 1.0, False))
            assert tracker.flush(timeout=scaled(10))
        assert wait_until(lambda: all(len(t.fetch(fresh=True)) == 3 for t in trackers), scaled(15))
        with caplog.at_level("INFO", logger="peer.optim"):
            trained = _train(
                nodes,
                2,
                load_state_timeout=scaled(120),
                averager_opts={"declare_state_period": 2.0},
            )
    finally:
        trackers[-1].shutdown()
        liar.shutdown()
    named = [r.getMessage() for r in caplog.records if liar.peer_id in r.getMessage()]
    assert named and all("ignored" in m for m in named), named
    for a, b in zip(*trained, strict=True):
        torch.testing.assert_close(a, b)


def _patient(node: Node, model: torch.nn.Module, run_id: str) -> Optimizer:
    """A peer whose round, once its batch completes the epoch, would look for a group for an
    hour: far longer than a test may take, unless the round is called off."""
    return Optimizer(
        node=node,
        run_id=run_id,
        target_batch_size=8,
        batch_size_per_step=8,
        optimizer=partial(torch.optim.SGD, lr=0.1),
        params=model.parameters(),
        matchmaking_time=0.5,
        averaging_timeout=scaled(3600),
    )


def test_a_round_nobody_can_join_any_more_is_called_off(nodes: list[Node]) -> None:
    """A peer looking for a group at epoch 0 while the only other peer has moved on to epoch
    5 gives up at once, instead of waiting out an ``averaging_timeout`` (here far longer
    than the test may take), and does not step alone: its next step loads the swarm's
    state."""
    models = [_model(), _model()]
    ahead, behind = (
        _patient(node, model, "moved-on") for node, model in zip(nodes, models, strict=True)
    )
    before = [p.detach().clone() for p in models[1].parameters()]
    try:
        ahead.step(batch_size=0)  # reports epoch 0: the round below has someone to wait for
        assert wait_until(lambda: behind.global_progress.num_peers == 2, scaled(20))
        x, y = _batch(1, 0)
        torch.nn.functional.mse_loss(models[1](x), y).backward()
        stepping = threading.Thread(target=behind.step)  # 8 samples: epoch 0 is complete
        stepping.start()
        assert wait_until(lambda: behind._pending.round is not None, scaled(20))
        ahead.local_epoch = 5  # as after five epochs this peer did on its own
        ahead.step(batch_size=0)
        stepping.join(scaled(60))
        assert not stepping.is_alive(), "the round waited for a group that cannot form"
        # called off, not failed; no step alone and no state round: the epoch is skipped
        assert behind.rounds_failed == 0 and behind.rounds_done == 0
        assert behind.local_epoch == 0 and behind.global_progress.epochs_behind == 5
        for p, b in zip(models[1].parameters(), before, strict=True):
            assert torch.equal(p, b)
    finally:
        for opt in (ahead, behind):
            opt.shutdown()


def test_a_round_whose_only_partner_left_the_swarm_is_called_off(nodes: list[Node]) -> None:
    """The only other peer at epoch 0 is cut off (a crash, a network split): its progress
    report outlives it, but once its membership lapses the round stops waiting for it,
    instead of waiting out an ``averaging_timeout`` (here far longer than the test may
    take), and this peer steps alone: nobody averaged without it."""
    ghost = Node(nodes[0].visible_addresses, gossip_period=0.2)
    tracker = ProgressTracker(ghost, "left", 8, expiration=3600.0)
    model = _model()
    lone = _patient(nodes[0], model, "left")
    before = [p.detach().clone() for p in model.parameters()]
    try:
        tracker.report(ProgressReport(ghost.peer_id, 0, 0, 0, time.time(), 1.0, False))
        assert tracker.flush(timeout=scaled(10))
        assert wait_until(lambda: lone.global_progress.num_peers == 2, scaled(20))
        x, y = _batch(0, 0)
        torch.nn.functional.mse_loss(model(x), y).backward()
        stepping = threading.Thread(target=lone.step)  # 8 samples: epoch 0 is complete
        stepping.start()
        assert wait_until(lambda: lone._pending.round is not None, scaled(20))
        ghost.shutdown()  # its report stays behind (nothing retracts it), its membership ends
        stepping.join(scaled(60))
        assert not stepping.is_alive(), "the round waited for a peer that left the swarm"
        assert ghost.peer_id not in nodes[0].members()
        assert lone.global_progress.num_peers == 2, "the test needs the report to outlive it"
        assert lone.local_epoch == 1 and lone.rounds_done == 0
        assert any(not torch.equal(p, b) for p, b in zip(model.parameters(), before, strict=True))
    finally:
        lone.shutdown()
        tracker.shutdown(timeout=0.1)
        ghost.shutdown()


def test_delayed_state_averaging_with_local_updates(nodes: list[Node]) -> None:
    """Parameter averaging in the background; local steps taken meanwhile are kept, and after
    the last epoch's round both peers hold the same model."""
    start = [p.detach().clone() for p in _model().parameters()]
    final = _train(nodes, 3, use_local_updates=True, delay_state_averaging=True)
    for a, b in zip(final[0], final[1], strict=True):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=0)
    assert any(not torch.allclose(a, b) for a, b in zip(final[0], start, strict=True))


def test_shutdown_stops_a_background_round_promptly(nodes: list[Node]) -> None:
    """A delayed gradient round whose only other peer at the epoch never joins looks for a
    group until its 60 s timeout: shutdown cancels it at once and leaves no thread behind."""
    before = set(threading.enumerate())
    model = _model()
    common = dict(
        run_id="stuck",
        target_batch_size=4,
        batch_size_per_step=4,
        optimizer=partial(torch.optim.SGD, lr=0.1),
        matchmaking_time=0.5,
        averaging_timeout=60.0,
        delay_grad_averaging=True,
    )
    idle = Optimizer(node=nodes[1], params=_model().parameters(), **common)  # never steps
    opt = Optimizer(node=nodes[0], params=model.parameters(), **common)
    assert wait_until(lambda: opt.global_progress.num_peers == 2, scaled(10))
    x, y = _batch(0, 0)
    torch.nn.functional.mse_loss(model(x), y).backward()
    opt.step()
    assert opt.local_epoch == 1 and opt.pending_update
    assert not opt.wait_for_pending(timeout=0.2), "the round is still looking for a group"
    started = time.monotonic()
    opt.shutdown()
    assert time.monotonic() - started < scaled(5)
    assert not opt.pending_update
    leftover = [t for t in threading.enumerate() if t not in before]
    assert not leftover, leftover
    opt.shutdown()  # idempotent
    idle.shutdown()
    with pytest.raises(RuntimeError, match="shut down"):
        opt.step()


def test_option_defaults_follow_hivemind() -> None:
    """No I/O: delay_optimizer_step follows delay_grad_averaging; offload_optimizer and
    delay_state_averaging follow delay_optimizer_step; explicit values are kept."""
    base = dict(
        offload_optimizer=None,
        delay_grad_averaging=False,
        delay_optimizer_step=None,
        delay_state_averaging=None,
        reuse_grad_buffers=False,
        use_local_updates=False,
        optimizer_is_factory=True,
    )
    plain = resolve_options(**base)
    assert not (plain.offload_optimizer or plain.delays_anything)
    grad = resolve_options(**{**base, "delay_grad_averaging": True})
    assert grad.delay_optimizer_step and grad.offload_optimizer and grad.delay_state_averaging
    state = resolve_options(**{**base, "delay_state_averaging": True})
    assert state.delay_state_averaging and not state.delay_optimizer_step
    assert not state.offload_optimizer, "delaying state rounds alone needs no offloading"
    local = resolve_options(
        **{
            **base,
            "use_local_updates": True,
            "delay_state_averaging": True,
            "optimizer_is_factory": False,
        }
    )
    assert local.use_local_updates and local.delay_state_averaging
