"""Collaborative optimizer: global batch semantics across real processes."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

WORKER = Path(__file__).with_name("collab_worker.py")
sys.path.insert(0, str(WORKER.parent))

from collab_worker import batch, make_model, make_optimizer  # noqa: E402


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
    procs = [_start(tmp_path, 0, sizes, epochs, None, *opts, continuous=False)]
    first = json.loads(procs[0].stdout.readline())["addresses"][0]
    procs += [
        _start(tmp_path, r, sizes, epochs, first, *opts, continuous=False)
        for r in range(1, len(sizes))
    ]
    for proc, log in zip(procs, _finish(procs), strict=True):
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
    results = _run_swarm(tmp_path, sizes, 1, "plain-sgd")
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


def _start(
    tmp_path: Path,
    rank: int,
    sizes: list[int],
    epochs: int,
    first: str | None,
    *extra: str,
    continuous: bool = True,
) -> subprocess.Popen:
    cmd = [
        sys.executable,
        str(WORKER),
        "--rank",
        str(rank),
        "--batch-sizes",
        ",".join(map(str, sizes)),
        "--epochs",
        str(epochs),
        "--out",
        str(tmp_path / f"rank{rank}.pt"),
        "--done-dir",
        str(tmp_path / "done"),
        *(["--continuous"] if continuous else []),
        *extra,
    ]
    if first:
        cmd += ["--initial-peer", first]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _all_logs(logs: list[str]) -> str:
    """The workers' stderr, for a failure message."""
    return "\n".join(f"--- rank {rank} ---\n{log}" for rank, log in enumerate(logs))


def _finish(procs: list[subprocess.Popen], timeout: float = 400) -> list[str]:
    logs = []
    try:
        for proc in procs:
            _, err = proc.communicate(timeout=timeout)
            logs.append(err)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
    return logs


@pytest.mark.slow
def test_latecomer_downloads_state_and_ends_in_step(tmp_path: Path) -> None:
    (tmp_path / "done").mkdir()
    sizes, epochs = [8, 8, 8, 8], 10
    # --verbose: each worker logs its peer id, its rounds and where it loaded state from
    founders = ("--verbose", "--wait-peers", "3")  # train together from the start
    procs = [_start(tmp_path, 0, sizes, epochs, None, *founders)]
    first = json.loads(procs[0].stdout.readline())["addresses"][0]
    procs += [_start(tmp_path, r, sizes, epochs, first, *founders) for r in (1, 2)]
    procs.append(_start(tmp_path, 3, sizes, epochs, first, "--start-epoch-wait", "5", "--verbose"))
    logs = _finish(procs)
    for proc in procs:
        assert proc.returncode == 0, _all_logs(logs)
    results = [torch.load(tmp_path / f"rank{r}.pt") for r in range(4)]
    assert results[3]["joined_at"] >= 5, (
        "the latecomer starts from the swarm's state, not from scratch\n" + _all_logs(logs)
    )
    assert [r["epoch"] for r in results] == [epochs] * 4, _all_logs(logs)
    # Everyone ends on the same model: the latecomer's state is the swarm's, not its own.
    for result in results[1:]:
        for mine, first_peer in zip(result["params"], results[0]["params"], strict=True):
            torch.testing.assert_close(
                mine, first_peer, atol=1e-5, rtol=0, msg=lambda m: m + "\n" + _all_logs(logs)
            )


@pytest.mark.slow
def test_peer_killed_during_gradient_averaging(tmp_path: Path) -> None:
    (tmp_path / "done").mkdir()
    for rank in range(3):
        (tmp_path / "done" / f"{rank}.expected").touch()  # survivors wait for each other only
    sizes, epochs = [8, 8, 8, 8], 5
    together = ("--wait-peers", "4")  # else the first one trains ahead alone
    procs = [_start(tmp_path, 0, sizes, epochs, None, *together)]
    first = json.loads(procs[0].stdout.readline())["addresses"][0]
    procs += [_start(tmp_path, r, sizes, epochs, first, *together) for r in (1, 2)]
    procs.append(_start(tmp_path, 3, sizes, epochs, first, *together, "--die-in-round", "2"))
    logs = _finish(procs)
    assert procs[3].returncode == -9, "the victim was SIGKILLed"
    for proc, log in zip(procs[:3], logs[:3], strict=True):
        assert proc.returncode == 0, log
        assert "Traceback" not in log and "ERROR" not in log, log
    results = [torch.load(tmp_path / f"rank{r}.pt") for r in range(3)]
    assert [r["epoch"] for r in results] == [epochs] * 3
    for result in results:
        assert all(torch.isfinite(p).all() for p in result["params"])
