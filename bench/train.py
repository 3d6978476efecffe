"""Training benchmarks: a swarm against one process, on the same sample budget, measured in
the same run.

    python bench/train.py                             # digits: 4 DecentralizedSGD peers, 30 epochs
    python bench/train.py --peers 2 --epochs 10
    python bench/train.py --task charlm --peers 2     # peer.Optimizer with the task's config
    python bench/train.py --task charlm --peers 2 --epochs 20 --config matchmaking_time=0.5
    python bench/train.py --methods all              # collaborative, hierarchical, DASO

Every peer and the single reference run in their own OS process (spawned, one torch thread
each), so neither side shares an interpreter lock.

``--task digits`` (the default) trains the digits MLP with DecentralizedSGD (local steps,
background parameter averaging) and prints:

* test accuracy of the single process and of every peer (after the final round the peers
  hold the same model), and the gap in points;
* samples/s: the single process's, and the swarm's (all peers' samples over the longest
  peer's training time), and their ratio.

``--methods collaborative,hierarchical,daso`` (or ``all``) trains the same digits recipe
with each method instead (:mod:`swarmlab.digits_compare`: 4 peers, the recipe's 30 epochs by default)
and prints, per method, the worst peer's accuracy and its gap to the single process, the
samples, the bytes each peer's node sent per sample and the seconds per epoch — the last two
also as ratios to the collaborative ``Optimizer`` measured in the same run.

``--against-mean SEEDS`` measures what a run's averaging defaults (the ``centered_clip``
aggregator and a relative weight bound, which one peer cannot take over) cost an honest run:
for each seed the swarm trains the task as a run does (digits too, with the collaborative
``peer.Optimizer`` as ``swarmgrad demo`` trains it) twice, with the defaults and with
``aggregator=mean, relative_weight_bound=null``, in alternating order, and prints the final
held-out metric of each, their mean and spread over the seeds and whether the difference is
within that spread, and the swarm's samples/s with the defaults over that with the mean
(paired runs: a ratio measured under the same load).

Any other task (``charlm``, ``package.module:function``) is trained as a run trains it: the
collaborative ``peer.Optimizer`` with the task's TrainingConfig (``--config key=value``
overrides it, as ``swarmgrad runs create --config`` does), one optimizer step per
``target_batch_size`` samples of the whole swarm; the single process takes the same steps on
its own (:func:`swarmlab.simulate.simulate_swarm` with one peer). Printed: the held-out
metric of both against epochs and samples processed (the swarm's from peer 0's parameters;
evaluated after training, so evaluation costs no one throughput), and the samples/s ratio.

The swarm pays for progress reports and for two rounds per epoch (gradients, then state),
each waiting ``matchmaking_time`` to gather its group; on a machine with fewer cores than
peers the ratio says more about the scheduler than about Swarmgrad — compare ratios across
changes on the same machine, not seconds.
"""

from __future__ import annotations

import argparse
import dataclasses
import multiprocessing
import queue
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from peer.tasks.digits import DigitsConfig, TrainResult


def _single_main(config: dict[str, Any], out: Any) -> None:
    import torch

    from peer.tasks.digits import train_single

    torch.set_num_threads(1)
    out.put(("single", dataclasses.asdict(train_single(DigitsConfig(**config)))))


def _peer_main(
    index: int, num_peers: int, bootstrap: list[str], config: dict[str, Any], out: Any
) -> None:
    import torch

    from peer import Node
    from peer.tasks.digits import train_peer

    torch.set_num_threads(1)
    with Node(bootstrap, gossip_period=0.2) as node:
        try:
            result = train_peer(node, index, num_peers, DigitsConfig(**config))
            out.put((index, dataclasses.asdict(result)))
        except Exception as exc:  # reported by the parent, which knows how many to expect
            out.put((index, repr(exc)))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--task", default="digits", help="digits, charlm or package.module:function"
    )
    parser.add_argument("--peers", type=int, default=4)
    parser.add_argument(
        "--epochs",
        type=int,
        default=None,
        help="digits: 30 passes; other tasks: 40 optimizer steps",
    )
    parser.add_argument("--batch-size", type=int, default=16, help="digits only")
    parser.add_argument("--eval-every", type=int, default=5, help="epochs between curve points")
    parser.add_argument(
        "--config", action="append", default=[], metavar="KEY=VALUE", help="not for digits"
    )
    parser.add_argument(
        "--methods",
        default=None,
        help="digits only: compare collaborative,hierarchical,daso (any of them, comma-"
        "separated, or 'all') against one process, instead of DecentralizedSGD",
    )
    parser.add_argument(
        "--against-mean",
        type=int,
        default=0,
        metavar="SEEDS",
        help="the cost of a run's robust averaging defaults: train the task (as a run does, "
        "digits included) over this many seeds with the defaults and with the plain mean",
    )
    parser.add_argument("--timeout", type=float, default=900.0)
    args = parser.parse_args(argv)
    if args.against_mean:
        return _against_mean_main(args)
    if args.task != "digits":
        return _collaborative_main(args)
    if args.methods:
        return _methods_main(args)
    args.epochs = args.epochs or 30
    config = dataclasses.asdict(DigitsConfig(epochs=args.epochs, batch_size=args.batch_size))
    ctx = multiprocessing.get_context("spawn")  # no dependence on fork
    out = ctx.Queue()

    single_proc = ctx.Process(target=_single_main, args=(config, out))
    single_proc.start()
    _, single_dict = out.get(timeout=args.timeout)
    single_proc.join()
    single = TrainResult(**single_dict)

    from peer import Node

    results: dict[int, TrainResult] = {}
    with Node(gossip_period=0.2) as bootstrap:  # a meeting point; it does not train
        procs = [
            ctx.Process(
                target=_peer_main, args=(i, args.peers, bootstrap.visible_addresses, config, out)
            )
            for i in range(args.peers)
        ]
        for proc in procs:
            proc.start()
        deadline = time.monotonic() + args.timeout
        errors = []
        for _ in procs:
            index, value = out.get(timeout=max(1.0, deadline - time.monotonic()))
            if isinstance(value, str):
                errors.append(f"peer {index}: {value}")
            else:
                results[index] = TrainResult(**value)
        for proc in procs:
            proc.join(timeout=30)
    if errors:
        print("\n".join(errors), file=sys.stderr)
        return 1

    peers = [results[i] for i in sorted(results)]
    swarm_samples = sum(r.samples for r in peers)
    swarm_seconds = max(r.seconds for r in peers)
    swarm_sps = swarm_samples / swarm_seconds
    single_sps = single.samples / single.seconds
    worst = min(r.accuracy for r in peers)
    print(
        f"digits: {args.peers} DecentralizedSGD peers vs one process, {args.epochs} epochs, batch {args.batch_size}"
    )
    print(f"  samples: swarm {swarm_samples}, single {single.samples}")
    print(
        f"  accuracy: single {single.accuracy:.4f}; peers "
        + ", ".join(f"{r.accuracy:.4f}" for r in peers)
    )
    print(f"  accuracy gap (single - worst peer): {100 * (single.accuracy - worst):+.2f} points")
    print(
        f"  averaging rounds per peer: {', '.join(str(r.averaging_rounds) for r in peers)}; swarm epoch at the end: {max(r.epoch for r in peers)}"
    )
    print(
        f"  samples/s: swarm {swarm_sps:.0f}, single {single_sps:.0f}, ratio swarm/single {swarm_sps / single_sps:.2f}"
    )
    return 0


# --------------------------------------------------------------------------- methods


def _method_peer(
    index: int, num_peers: int, bootstrap: list[str], config: dict[str, Any], method: str
) -> dict[str, Any]:
    from peer import Node
    from swarmlab.digits_compare import train_peer_with

    with Node(bootstrap, gossip_period=0.2) as node:
        result = train_peer_with(node, index, num_peers, DigitsConfig(**config), method)
    return dataclasses.asdict(result)


def _methods_main(args: argparse.Namespace) -> int:
    """Every method on the same shards, peers and recipe; ratios against the collaborative
    ``Optimizer`` measured in the same run."""
    from peer import Node
    from swarmlab.digits_compare import METHODS

    methods = list(METHODS) if args.methods == "all" else args.methods.split(",")
    unknown = sorted(set(methods) - set(METHODS))
    if unknown:
        raise SystemExit(f"unknown method(s) {', '.join(unknown)}: use {', '.join(METHODS)}")
    args.epochs = args.epochs or 30
    config = dataclasses.asdict(DigitsConfig(epochs=args.epochs, batch_size=args.batch_size))
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    single_proc = ctx.Process(target=_single_main, args=(config, out))
    single_proc.start()
    _, single_dict = out.get(timeout=args.timeout)
    single_proc.join()
    single = TrainResult(**single_dict)
    rows: dict[str, list[TrainResult]] = {}
    for method in methods:
        with Node(gossip_period=0.2) as bootstrap:
            procs = [
                ctx.Process(
                    target=_child,
                    args=(
                        _method_peer,
                        i,
                        out,
                        i,
                        args.peers,
                        bootstrap.visible_addresses,
                        config,
                        method,
                    ),
                )
                for i in range(args.peers)
            ]
            for proc in procs:
                proc.start()
            found: dict[int, TrainResult] = {}
            for _ in procs:
                index, value = out.get(timeout=args.timeout)
                if isinstance(value, str):
                    print(f"{method}, peer {index}: {value}", file=sys.stderr)
                    return 1
                found[index] = TrainResult(**value)
            for proc in procs:
                proc.join(timeout=30)
        rows[method] = [found[i] for i in sorted(found)]
    print(
        f"digits: {args.peers} peers of one process each vs one process, {args.epochs} epochs, "
        f"batch {args.batch_size}; single process: accuracy {single.accuracy:.4f}, "
        f"{single.samples} samples"
    )
    reference = rows.get("collaborative")
    header = (
        f"  {'method':<14}{'accuracy':>9}{'gap':>8}{'samples':>9}{'B/sample':>10}{'s/epoch':>9}"
    )
    if reference:
        header += f"{'B/sample vs collab':>20}{'s/epoch vs collab':>19}"
    print(header)

    def figures(peers: list[TrainResult]) -> tuple[float, float]:
        per_sample = sum(r.bytes_sent for r in peers) / sum(r.samples for r in peers)
        return per_sample, max(r.seconds for r in peers) / args.epochs

    for method, peers in rows.items():
        worst = min(r.accuracy for r in peers)
        per_sample, per_epoch = figures(peers)
        line = (
            f"  {method:<14}{worst:>9.4f}{100 * (single.accuracy - worst):>+8.2f}"
            f"{sum(r.samples for r in peers):>9}{per_sample:>10.0f}{per_epoch:>9.2f}"
        )
        if reference:
            ref_sample, ref_epoch = figures(reference)
            line += f"{per_sample / ref_sample:>20.2f}{per_epoch / ref_epoch:>19.2f}"
        print(line)
    print("  (accuracy: the worst peer's; gap: single - worst, in points)")
    return 0


# --------------------------------------------------------------------------- other tasks


def _child(target: Any, key: Any, out: Any, *args: Any) -> None:
    """Run ``target(*args)`` in a spawned process; put ``(key, result)``, or ``(key, error
    text)`` if it raised, on ``out``: the parent, which knows how many to expect, reports it."""
    import torch

    torch.set_num_threads(1)
    try:
        out.put((key, target(*args)))
    except Exception as exc:
        out.put((key, repr(exc)))


def _single_task(
    task_name: str, run_config: dict[str, Any], epochs: int, every: int
) -> dict[str, Any]:

    from peer.tasks import TrainingConfig, load_task
    from swarmlab.simulate import simulate_swarm

    task = load_task(task_name)
    config = TrainingConfig.from_run_config(task, run_config)
    result = simulate_swarm(task, config, epochs=epochs, evaluate_every=every)
    curve = [(p.epoch, p.samples, p.metric) for p in result.curve]
    return {"curve": curve, "samples": result.samples, "seconds": result.seconds}


def _swarm_peer(
    index: int,
    num_peers: int,
    bootstrap: list[str],
    task_name: str,
    run_config: dict[str, Any],
    epochs: int,
    every: int,
    finished: Any,
) -> dict[str, Any]:
    """One peer: trains as a volunteer does until the swarm reaches ``epochs``; peer 0 keeps
    copies of its parameters every ``every`` epochs and evaluates them afterwards."""
    import torch

    from peer import Node
    from peer.optim.collaborative.optimizer import Optimizer
    from peer.tasks import TrainingConfig, load_task
    from peer.trainer import compute_gradients, set_lr
    from swarmlab.node_process import wait_until

    task = load_task(task_name)
    config = TrainingConfig.from_run_config(task, run_config)
    with Node(bootstrap, gossip_period=0.2) as node:
        model = task.build_model(config)
        opt = Optimizer(
            node=node,
            run_id="bench-train",
            params=model.parameters(),
            **config.optimizer_options(),
        )
        try:
            # a peer alone skips the rounds: start together
            if not wait_until(lambda: opt.tracker.others_reporting() >= num_peers - 1, 120):
                raise RuntimeError("the other peers did not show up")
            snapshots: dict[int, dict[str, torch.Tensor]] = {}
            samples_at = {0: 0}  # epoch -> samples this peer had processed when it got there
            samples = 0

            def snapshot() -> None:
                epoch = opt.local_epoch
                samples_at.setdefault(epoch, samples)
                if index == 0 and epoch % every == 0 and epoch not in snapshots:
                    snapshots[epoch] = {k: v.clone() for k, v in model.state_dict().items()}

            snapshot()
            batches = task.train_batches(config, node.peer_id)
            start = time.perf_counter()
            while opt.local_epoch < epochs:
                # a volunteer's step (peer.trainer): the run's micro-batches, precision,
                # clipping and the schedule's rate at the swarm's epoch
                set_lr(opt, config.lr_at(opt.local_epoch))
                micro = [next(batches) for _ in range(config.accumulation)]
                _, n = compute_gradients(task, model, micro, config)
                opt.step(batch_size=n)
                opt.zero_grad()
                samples += n
                snapshot()
            seconds = time.perf_counter() - start
            with finished.get_lock():
                finished.value += 1
            # stay for the others' last rounds and state downloads
            wait_until(lambda: opt.step(batch_size=0) or finished.value >= num_peers, 120, 0.05)
            rounds = (opt.rounds_done, opt.rounds_failed, opt.last_group_size)
        finally:
            opt.shutdown()
    curve = []
    for epoch, state in sorted(snapshots.items()):
        model.load_state_dict(state)
        curve.append((epoch, task.evaluate(model, config)))
    return {
        "samples": samples,
        "seconds": seconds,
        "samples_at": samples_at,
        "curve": curve,
        "rounds": rounds,
    }


def _parse_config(items: list[str]) -> dict[str, Any]:
    """``key=value`` pairs, as ``--config`` of the CLI reads them (a value is JSON when it
    parses as JSON)."""
    import typer

    from swarmgrad.organizer import parse_config

    try:
        return parse_config(items)
    except typer.BadParameter as exc:
        raise SystemExit(f"--config: {exc}") from None


def _run_swarm(
    args: argparse.Namespace, run_config: dict[str, Any], epochs: int, every: int
) -> list[dict[str, Any]] | str:
    """Train ``args.peers`` peers (each its own process) on ``args.task`` with
    ``run_config`` until the swarm reaches ``epochs``: each peer's figures, or what failed."""
    ctx = multiprocessing.get_context("spawn")  # no dependence on fork
    out = ctx.Queue()

    from peer import Node

    finished = ctx.Value("i", 0)
    results: dict[int, dict[str, Any]] = {}
    errors = []
    with Node(gossip_period=0.2) as bootstrap:  # a meeting point; it does not train
        procs = [
            ctx.Process(
                target=_child,
                args=(
                    _swarm_peer,
                    i,
                    out,
                    i,
                    args.peers,
                    bootstrap.visible_addresses,
                    args.task,
                    run_config,
                    epochs,
                    every,
                    finished,
                ),
            )
            for i in range(args.peers)
        ]
        for proc in procs:
            proc.start()
        deadline = time.monotonic() + args.timeout
        for _ in procs:
            try:
                index, value = out.get(timeout=max(1.0, deadline - time.monotonic()))
            except queue.Empty:
                errors.append("timed out waiting for the peers")
                break
            if isinstance(value, str):
                errors.append(f"peer {index}: {value}")
            else:
                results[index] = value
        for proc in procs:
            proc.join(timeout=30)
            if proc.exitcode is None:
                proc.kill()
    if errors or len(results) != args.peers:
        return "\n".join(errors) or "a peer did not report"
    return [results[i] for i in range(args.peers)]


def _collaborative_main(args: argparse.Namespace) -> int:
    from peer.tasks import TrainingConfig, load_task

    task = load_task(args.task)
    run_config = _parse_config(args.config)
    config = TrainingConfig.from_run_config(task, run_config)  # checked before anything starts
    epochs = args.epochs or 40
    every = max(1, args.eval_every)
    ctx = multiprocessing.get_context("spawn")  # no dependence on fork
    out = ctx.Queue()
    single_proc = ctx.Process(
        target=_child, args=(_single_task, "single", out, args.task, run_config, epochs, every)
    )
    single_proc.start()
    _, single = out.get(timeout=args.timeout)
    single_proc.join()
    if isinstance(single, str):
        print(f"single process: {single}", file=sys.stderr)
        return 1
    peers = _run_swarm(args, run_config, epochs, every)
    if isinstance(peers, str):
        print(peers, file=sys.stderr)
        return 1

    swarm_samples = sum(p["samples"] for p in peers)
    swarm_sps = swarm_samples / max(p["seconds"] for p in peers)
    single_sps = single["samples"] / single["seconds"]
    single_curve = {epoch: (samples, metric) for epoch, samples, metric in single["curve"]}
    metric = task.metric_name
    print(
        f"{task.name}: one process vs a swarm of {args.peers} peers (peer.Optimizer), "
        f"{epochs} epochs of {config.target_batch_size} samples; {config.optimizer} "
        f"lr {config.lr:g}, batch {config.batch_size}, matchmaking {config.matchmaking_time:g} s"
    )
    print(f"  {metric} ({'higher' if task.higher_is_better else 'lower'} is better):")
    print(f"  {'epoch':>6} {'samples':>9} {'single':>8} {'samples':>9} {'swarm':>8}")
    for epoch, value in peers[0]["curve"]:
        # the swarm's samples when peer 0 reached this epoch: every peer's count at it
        swarm_at = sum(_samples_at(p["samples_at"], epoch) for p in peers)
        alone = single_curve.get(epoch)
        left = f"{alone[0]:>9} {alone[1]:>8.4f}" if alone else f"{'':>9} {'':>8}"
        print(f"  {epoch:>6} {left} {swarm_at:>9} {value:>8.4f}")
    print(
        f"  samples: single {single['samples']}, swarm {swarm_samples} "
        f"({', '.join(str(p['samples']) for p in peers)} per peer)"
    )
    print(
        "  rounds per peer (done, failed, last group size): "
        + ", ".join(str(tuple(p["rounds"])) for p in peers)
    )
    print(
        f"  samples/s: single {single_sps:.0f}, swarm {swarm_sps:.0f}, "
        f"ratio swarm/single {swarm_sps / single_sps:.2f}"
    )
    return 0


#: the averaging a run had before it was open to strangers
PLAIN_MEAN = {"aggregator": "mean", "relative_weight_bound": None}


def _against_mean_main(args: argparse.Namespace) -> int:
    import statistics

    from peer.tasks import TrainingConfig, load_task

    task = load_task(args.task)
    base = _parse_config(args.config)
    if {"aggregator", "relative_weight_bound", "seed"} & base.keys():
        raise SystemExit("--against-mean sets aggregator, relative_weight_bound and seed itself")
    defaults = TrainingConfig.from_run_config(task, base)
    epochs = args.epochs or 40
    print(
        f"{task.name}: {args.peers} peers (peer.Optimizer), {epochs} epochs of "
        f"{defaults.target_batch_size} samples, {args.against_mean} seeds; defaults "
        f"aggregator={defaults.aggregator} relative_weight_bound={defaults.relative_weight_bound}"
        f" against aggregator=mean with no bound"
    )
    print(
        f"  {task.metric_name}, final ({'higher' if task.higher_is_better else 'lower'} is better)"
    )
    print(f"  {'seed':>4} {'defaults':>9} {'mean':>9} {'samples/s ratio':>16}")
    figures: dict[str, list[float]] = {"defaults": [], "mean": []}
    ratios = []
    for seed in range(args.against_mean):
        pair = [("defaults", {}), ("mean", PLAIN_MEAN)]
        if seed % 2:
            pair.reverse()  # alternate which goes first: load drifts across a long bench
        speed = {}
        metric = {}
        for name, extra in pair:
            peers = _run_swarm(args, {**base, "seed": seed, **extra}, epochs, epochs)
            if isinstance(peers, str):
                print(f"seed {seed}, {name}: {peers}", file=sys.stderr)
                return 1
            metric[name] = float(peers[0]["curve"][-1][1])
            speed[name] = sum(p["samples"] for p in peers) / max(p["seconds"] for p in peers)
            figures[name].append(metric[name])
        ratios.append(speed["defaults"] / speed["mean"])
        print(f"  {seed:>4} {metric['defaults']:>9.4f} {metric['mean']:>9.4f} {ratios[-1]:>16.3f}")
    spread = {k: statistics.stdev(v) if len(v) > 1 else 0.0 for k, v in figures.items()}
    means = {k: statistics.fmean(v) for k, v in figures.items()}
    gap = means["defaults"] - means["mean"]
    worse = -gap if task.higher_is_better else gap  # what the defaults cost, in the metric
    noise = max(spread.values())
    if abs(gap) <= noise:
        verdict = "within the seeds' spread"
    elif worse < 0:
        verdict = "better by more than the seeds' spread"
    else:
        verdict = "WORSE by more than the seeds' spread"
    print(
        f"  mean over seeds: defaults {means['defaults']:.4f} (sd {spread['defaults']:.4f}), "
        f"mean {means['mean']:.4f} (sd {spread['mean']:.4f}); difference {gap:+.4f}: {verdict}"
    )
    geo = statistics.geometric_mean(ratios)
    print(
        f"  samples/s with the defaults / with the mean: {geo:.3f} "
        f"(pairs {min(ratios):.3f}-{max(ratios):.3f})"
    )
    return 1 if verdict.startswith("WORSE") else 0


def _samples_at(samples_at: dict[int, int], epoch: int) -> int:
    """A peer's samples at ``epoch``, or at the first later epoch it reached (it loaded the
    swarm's state instead of stepping through it)."""
    later = [e for e in samples_at if e >= epoch]
    return samples_at[min(later)] if later else max(samples_at.values())


if __name__ == "__main__":
    sys.exit(main())
