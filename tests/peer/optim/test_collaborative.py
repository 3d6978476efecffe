"""Collaborative optimizer: global batch semantics across real processes."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from tests.peer.optim.collab_swarm import (
    WORKER,
    all_logs,
    assert_same_model,
    finish_workers,
    first_address,
    start_worker,
)

sys.path.insert(0, str(WORKER.parent))

from collab_worker import batch, make_model, make_optimizer


def _reference(
    sizes: list[int], epochs: int, optimizer: str, *, stale: bool = False
) -> list[torch.Tensor]:
    """One process, one step per epoch on the concatenated batches of every rank. ``stale``:
    the gradients of epoch k are taken at the parameters from before epoch k-1's update
    (delayed updates, θ[k+1] = step(θ[k], ∇L_k(θ[k-1])))."""
    model, probe = make_model(), make_model()
    opt = make_optimizer(optimizer)(model.parameters())
    before = [p.detach().clone() for p in model.parameters()]
    for epoch in range(epochs):
        at = before if stale else [p.detach().clone() for p in model.parameters()]
        before = [p.detach().clone() for p in model.parameters()]
        with torch.no_grad():
            for q, value in zip(probe.parameters(), at, strict=True):
                q.copy_(value)
        xs, ys = zip(*(batch(rank, epoch, size) for rank, size in enumerate(sizes)), strict=True)
        probe.zero_grad()
        torch.nn.functional.mse_loss(probe(torch.cat(xs)), torch.cat(ys)).backward()
        for p, q in zip(model.parameters(), probe.parameters(), strict=True):
            p.grad = q.grad
        opt.step()
    return [p.detach() for p in model.parameters()]


def _run_swarm(
    tmp_path: Path, sizes: list[int], epochs: int, optimizer: str, *extra: str
) -> list[dict]:
    """One worker per batch size, each doing one batch per epoch; their final states."""
    (tmp_path / "done").mkdir()
    opts = ("--optimizer", optimizer, *extra)
    procs = [start_worker(tmp_path, 0, sizes, epochs, None, *opts, continuous=False)]
    first = first_address(procs[0])
    procs += [
        start_worker(tmp_path, r, sizes, epochs, first, *opts, continuous=False)
        for r in range(1, len(sizes))
    ]
    for proc, log in zip(procs, finish_workers(tmp_path, procs), strict=True):
        assert proc.returncode == 0, log
    return [torch.load(tmp_path / f"rank{r}.pt") for r in range(len(sizes))]


@pytest.mark.slow
@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_four_peers_equal_single_process_training(tmp_path: Path, optimizer: str) -> None:
    sizes, epochs = [8, 8, 8, 8], 10
    # every round assembles once the four are in, not after a fixed matchmaking time
    results = _run_swarm(tmp_path, sizes, epochs, optimizer, "--target-group-size", "4")
    reference = _reference(sizes, epochs, optimizer)
    for result in results:
        assert result["epoch"] == epochs
        for mine, expected in zip(result["params"], reference, strict=True):
            torch.testing.assert_close(mine, expected, atol=1e-5, rtol=0)
        # a gradient and a state round per epoch, counted for progress reports
        done, failed, group_size = result["rounds"]
        assert (done, failed) == (2 * epochs, 0)
        assert group_size == 4


@pytest.mark.slow
def test_delayed_gradient_averaging_across_processes(tmp_path: Path) -> None:
    """delay_grad_averaging (so a delayed optimizer step on offloaded parameters, and state
    rounds in the background): three processes, Adam, uneven batches. Every peer ends on
    single-process training with one-step-stale gradients, while batches were accumulated
    during background rounds (double-buffered: none lost or counted twice)."""
    sizes, epochs = [8, 16, 8], 4
    results = _run_swarm(tmp_path, sizes, epochs, "adam", "--delay-grad-averaging")
    stale = _reference(sizes, epochs, "adam", stale=True)
    synchronous = _reference(sizes, epochs, "adam")
    assert any((a - b).abs().max() > 1e-4 for a, b in zip(stale, synchronous, strict=True))
    for result in results:
        assert result["epoch"] == epochs
        for mine, expected in zip(result["params"], stale, strict=True):
            torch.testing.assert_close(mine, expected, atol=1e-5, rtol=0)
    assert sum(r["overlapped"] for r in results) > 0, "compute overlapped a background round"


@pytest.mark.slow
def test_uneven_peers_average_the_sample_weighted_gradient(tmp_path: Path) -> None:
    """Batch sizes 8, 16 and 32, plain SGD with lr=1 for one epoch: every peer's parameter
    change is exactly minus the gradient of the mean loss over all 56 samples."""
    sizes = [8, 16, 32]
    results = _run_swarm(tmp_path, sizes, 1, "plain-sgd", "--target-group-size", "3")
    model = make_model()
    xs, ys = zip(*(batch(rank, 0, size) for rank, size in enumerate(sizes)), strict=True)
    torch.nn.functional.mse_loss(model(torch.cat(xs)), torch.cat(ys)).backward()
    # The naive (unweighted) mean of the three peers' gradients differs: the test can tell.
    naive = []
    for rank, size in enumerate(sizes):
        m = make_model()
        x, y = batch(rank, 0, size)
        torch.nn.functional.mse_loss(m(x), y).backward()
        naive.append([p.grad for p in m.parameters()])
    for result in results:
        for p, after, *per_peer in zip(model.parameters(), result["params"], *naive, strict=True):
            torch.testing.assert_close(p.detach() - after, p.grad, atol=1e-6, rtol=0)
            assert not torch.allclose(p.grad, sum(per_peer) / 3, atol=1e-4)


@pytest.mark.slow
def test_latecomer_downloads_state_and_ends_in_step(tmp_path: Path) -> None:
    (tmp_path / "done").mkdir()
    sizes, epochs = [8, 8, 8, 8], 10
    # --verbose: each worker logs its peer id, its rounds and where it loaded state from
    # once the latecomer is in, every round assembles as soon as the four are (before, the
    # three founders' rounds take the whole matchmaking time)
    four = ("--verbose", "--target-group-size", "4")
    founders = (*four, "--wait-peers", "3")  # train together from the start
    procs = [start_worker(tmp_path, 0, sizes, epochs, None, *founders)]
    first = first_address(procs[0])
    procs += [start_worker(tmp_path, r, sizes, epochs, first, *founders) for r in (1, 2)]
    procs.append(start_worker(tmp_path, 3, sizes, epochs, first, "--start-epoch-wait", "5", *four))
    logs = finish_workers(tmp_path, procs)
    for proc in procs:
        assert proc.returncode == 0, all_logs(logs)
    results = [torch.load(tmp_path / f"rank{r}.pt") for r in range(4)]
    assert results[3]["joined_at"] >= 5, (
        "the latecomer starts from the swarm's state, not from scratch\n" + all_logs(logs)
    )
    assert [r["epoch"] for r in results] == [epochs] * 4, all_logs(logs)
    # Everyone ends on the same model: the latecomer's state is the swarm's, not its own.
    assert_same_model(results, logs)


@pytest.mark.slow
def test_peer_killed_during_gradient_averaging(tmp_path: Path) -> None:
    (tmp_path / "done").mkdir()
    for rank in range(3):
        (tmp_path / "done" / f"{rank}.expected").touch()  # survivors wait for each other only
    sizes, epochs = [8, 8, 8, 8], 5
    together = ("--wait-peers", "4")  # else the first one trains ahead alone
    procs = [start_worker(tmp_path, 0, sizes, epochs, None, *together)]
    first = first_address(procs[0])
    procs += [start_worker(tmp_path, r, sizes, epochs, first, *together) for r in (1, 2)]
    procs.append(start_worker(tmp_path, 3, sizes, epochs, first, *together, "--die-in-round", "2"))
    logs = finish_workers(tmp_path, procs)
    assert procs[3].returncode == -9, "the victim was SIGKILLed"
    for proc, log in zip(procs[:3], logs[:3], strict=True):
        assert proc.returncode == 0, log
        assert "Traceback" not in log and "ERROR" not in log, log
    results = [torch.load(tmp_path / f"rank{r}.pt") for r in range(3)]
    assert [r["epoch"] for r in results] == [epochs] * 3
    for result in results:
        assert all(torch.isfinite(p).all() for p in result["params"])
