"""The GPT-2 example (``examples/gpt2.py``) trained by a swarm against one process alone, on
the same samples, repeated to show the spread.

    python bench/gpt2.py                       # 3 peers, 20 epochs, 3 repetitions
    python bench/gpt2.py --epochs 40 --runs 5 --config precision=bf16

Each repetition: ``--peers`` peers, each in its own spawned process (one torch thread), train
with the collaborative ``peer.Optimizer`` as a volunteer's trainer does
(:func:`peer.trainer.set_lr` at the swarm epoch's scheduled rate,
:func:`peer.trainer.compute_gradients` with the run's accumulation, precision and clipping).
Every epoch each peer contributes one step of its own stream's samples (``target_batch_size``
is the peers' steps summed), then waits for the swarm's epoch to move; the single process
steps on exactly those samples, every peer's, as micro-batches of one step. So the two train
on the same samples with the same schedule, and differ only by what averaging changes — and
by clipping (the example clips at 1.0): the swarm clips each peer's share of a step, the
single process the whole step's gradient.

Printed per repetition and as mean and spread (min to max) over them:

* the held-out loss of the single process and of the swarm (peer 0; every peer ends on the
  same parameters), and their ratio swarm/single (1.0: the same model);
* the overhead: the swarm's training time (its slowest peer's) over the single process's,
  for the same samples. Each peer computes a ``1/peers`` share, so compute alone would give
  ``1/peers``; the rest is averaging (two rounds per epoch, each gathering its group) and the
  cores the peers share. A ratio, measured in the same run: compare it across changes on one
  machine, not across machines.
"""

from __future__ import annotations

import argparse
import importlib.util
import multiprocessing
import queue
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
EXAMPLE = ROOT / "examples" / "gpt2.py"
RUN_ID = "bench-gpt2"


def _task() -> Any:
    spec = importlib.util.spec_from_file_location("example_gpt2", EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.task()


def _config(task: Any, run_config: dict[str, Any], peers: int) -> Any:
    from peer.tasks.base import TrainingConfig

    base = TrainingConfig.from_run_config(task, run_config)
    # one step of every peer makes an epoch
    return TrainingConfig.from_run_config(
        task, {**run_config, "target_batch_size": peers * base.samples_per_step}
    )


def _micro_batches(task: Any, config: Any, streams: list[Any], rank: int) -> list[Any]:
    return [next(streams[rank]) for _ in range(config.accumulation)]


def _single(run_config: dict[str, Any], peers: int, epochs: int) -> dict[str, Any]:
    """One process on every peer's samples of every epoch, one step per epoch."""
    import torch

    from peer.trainer import compute_gradients, set_lr

    torch.set_num_threads(1)
    task = _task()
    config = _config(task, run_config, peers)
    model = task.build_model(config)
    opt = config.make_optimizer()(model.parameters())
    streams = [task.train_batches(config, f"peer-{rank}") for rank in range(peers)]
    start = time.perf_counter()
    for epoch in range(epochs):
        batches = [b for rank in range(peers) for b in _micro_batches(task, config, streams, rank)]
        set_lr(opt, config.lr_at(epoch))
        compute_gradients(task, model, batches, config)
        opt.step()
        opt.zero_grad()
    seconds = time.perf_counter() - start
    return {"loss": task.evaluate(model, config), "seconds": seconds}


def _peer(
    rank: int,
    peers: int,
    bootstrap: list[str],
    run_config: dict[str, Any],
    epochs: int,
    finished: Any,
) -> dict[str, Any]:
    """One peer: each epoch one step on its stream's samples, then it waits for the swarm."""
    import torch

    from peer import Node
    from peer.trainer import compute_gradients, set_lr
    from swarmlab.node_process import wait_until

    torch.set_num_threads(1)
    task = _task()
    config = _config(task, run_config, peers)
    streams = [task.train_batches(config, f"peer-{r}") for r in range(peers)]
    with Node(bootstrap, gossip_period=0.2) as node:
        model = task.build_model(config)
        opt = config.make_swarm_optimizer(
            node, RUN_ID, model.parameters(), averager_opts={"target_group_size": peers}
        )
        try:
            if not wait_until(lambda: opt.tracker.others_reporting() >= peers - 1, 120):
                raise RuntimeError("the other peers did not show up")
            start = time.perf_counter()
            while opt.local_epoch < epochs:
                epoch = opt.local_epoch
                set_lr(opt, config.lr_at(epoch))
                batches = _micro_batches(task, config, streams, rank)
                _, n = compute_gradients(task, model, batches, config)
                opt.step(batch_size=n)
                opt.zero_grad()
                moved = wait_until(
                    lambda epoch=epoch: opt.step(batch_size=0) or opt.local_epoch != epoch,
                    120,
                    0.01,
                )
                if not moved:
                    raise RuntimeError(f"the swarm stayed at epoch {epoch}")
            seconds = time.perf_counter() - start
            with finished.get_lock():
                finished.value += 1
            # stay for the others' last rounds
            wait_until(lambda: opt.step(batch_size=0) or finished.value >= peers, 120, 0.05)
        finally:
            opt.shutdown()
    return {"loss": task.evaluate(model, config), "seconds": seconds}


def _child(target: Any, key: Any, out: Any, *args: Any, **kwargs: Any) -> None:
    try:
        out.put((key, target(*args, **kwargs)))
    except Exception as exc:
        out.put((key, repr(exc)))


def _swarm(run_config: dict[str, Any], peers: int, epochs: int, timeout: float) -> Any:
    from peer import Node

    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    finished = ctx.Value("i", 0)
    results: dict[int, Any] = {}
    with Node(gossip_period=0.2) as bootstrap:  # a meeting point; it does not train
        procs = [
            ctx.Process(
                target=_child,
                args=(_peer, r, out, *(r, peers, bootstrap.visible_addresses)),
                kwargs={"run_config": run_config, "epochs": epochs, "finished": finished},
            )
            for r in range(peers)
        ]
        for proc in procs:
            proc.start()
        deadline = time.monotonic() + timeout
        try:
            for _ in procs:
                key, value = out.get(timeout=max(1.0, deadline - time.monotonic()))
                results[key] = value
        except queue.Empty:
            results[-1] = "timed out waiting for the peers"
        for proc in procs:
            proc.join(timeout=30)
            if proc.exitcode is None:
                proc.kill()
    errors = [f"peer {k}: {v}" for k, v in results.items() if isinstance(v, str)]
    if errors or len(results) != peers:
        raise SystemExit("\n".join(errors) or "a peer did not report")
    return [results[r] for r in range(peers)]


def _parse_config(items: list[str]) -> dict[str, Any]:
    """``key=value`` pairs, as ``--config`` of the CLI reads them (a value is JSON when it
    parses as JSON)."""
    import typer

    from swarmgrad.organizer import parse_config

    try:
        return parse_config(items)
    except typer.BadParameter as exc:
        raise SystemExit(f"--config: {exc}") from None


def _spread(values: list[float]) -> str:
    return f"{statistics.fmean(values):.3f} ({min(values):.3f} to {max(values):.3f})"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--peers", type=int, default=3)
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--runs", type=int, default=3, help="repetitions, for the spread")
    parser.add_argument("--config", action="append", default=[], help="key=value, repeatable")
    parser.add_argument("--timeout", type=float, default=900.0)
    args = parser.parse_args(argv)
    run_config = {"epochs": args.epochs, **_parse_config(args.config)}
    task = _task()
    config = _config(task, run_config, args.peers)  # checked before anything starts
    print(
        f"gpt2 example: {args.peers} peers against one process, {args.epochs} epochs of "
        f"{config.target_batch_size} windows; {config.optimizer} lr {config.lr:g} "
        f"({config.lr_schedule}, warm-up {config.warmup_epochs}), precision "
        f"{config.precision}, accumulation {config.accumulation}"
    )
    print(f"  {'run':>3} {'single loss':>11} {'swarm loss':>10} {'ratio':>6} {'overhead':>8}")
    ratios, overheads = [], []
    ctx = multiprocessing.get_context("spawn")
    for run in range(1, args.runs + 1):
        out = ctx.Queue()
        proc = ctx.Process(
            target=_child, args=(_single, "single", out, run_config, args.peers, args.epochs)
        )
        proc.start()
        _, single = out.get(timeout=args.timeout)
        proc.join()
        if isinstance(single, str):
            raise SystemExit(f"single process: {single}")
        peers = _swarm(run_config, args.peers, args.epochs, args.timeout)
        swarm_loss = peers[0]["loss"]
        ratio = swarm_loss / single["loss"]
        overhead = max(p["seconds"] for p in peers) / single["seconds"]
        ratios.append(ratio)
        overheads.append(overhead)
        print(
            f"  {run:>3} {single['loss']:>11.4f} {swarm_loss:>10.4f} {ratio:>6.3f} {overhead:>8.2f}"
        )
    print(f"  held-out loss swarm/single: {_spread(ratios)}")
    print(f"  overhead (swarm time / single time, same samples): {_spread(overheads)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
