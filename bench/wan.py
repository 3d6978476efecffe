"""Training over home links: the collaborative Optimizer against DiLoCo, measured.

    .venv/bin/python bench/wan.py [--peers 4] [--rate 50] [--rtt 50] [--samples 8192]
                                  [--plot wan.png] [--mix SEED] [--check]

Puts ``--peers`` processes behind emulated home links (:mod:`swarmlab.netlab`: a network
namespace each, ``--rate`` Mbit/s each way by tc's token bucket, ``--rtt`` ms of round trip
by a delay line; ``--mix SEED`` draws a heterogeneous mix of 20-200 Mbit/s and 10-150 ms
instead; needs root and iproute2). They train the same model, charlm's byte-level
transformer (:mod:`peer.tasks.charlm`, one torch thread per peer), from the same
initialisation on ``--samples`` samples in all, once per method:

* ``optimizer``: the collaborative ``peer.Optimizer`` as a run configures it (a global batch
  of ``--target`` samples per epoch, the gradient and the state averaged every epoch);
* ``optimizer+delay``: the same with ``delay_grad_averaging`` and ``delay_optimizer_step``;
* ``diloco``: ``peer.DiLoCo`` with ``--inner-steps`` AdamW steps per outer round, no
  compression, rounds in the foreground;
* ``streaming``: DiLoCo with ``--fragments`` fragments, ``overlap=True`` and int8
  pseudo-gradients.

Per method it prints compute utilisation (the fraction of the training loop's time spent
in forward, backward and the optimizer's own step: a ``step()`` call's time beyond its
inner step, which DiLoCo times in the call, or beyond an AdamW step on the model measured
in the same process before training for the collaborative Optimizer, is waiting on the
network, :mod:`peer.optim.utilisation`), and for DiLoCo where that waiting went; bytes each
peer's node sent per
sample it trained, the swarm's samples/s, and peer 0's held-out loss at the end (equal
samples) and at the wall time the fastest method took (equal wall time, interpolated between
evaluated snapshots). Then the goals, each a ratio from this run: streaming DiLoCo's compute
utilisation, the collaborative Optimizer's bytes per sample over streaming DiLoCo's, and
their held-out losses at equal samples. ``--plot`` saves peer 0's held-out loss against wall
time and against samples, one line per method, as a PNG (matplotlib, in the dev extra).
``--check`` exits with status 1 when a goal is missed.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

PORT = 7700  # in every peer's own namespace: no clash with the machine's ports
METHODS = ("optimizer", "optimizer+delay", "diloco", "streaming")
GOAL_UTILISATION, GOAL_BYTES, GOAL_LOSS = 0.95, 100.0, 1.03


# ------------------------------------------------------------------------------ worker


def _build(method: str, model: Any, node: Any, run: str, config: Any, cfg: dict[str, Any]) -> Any:
    import torch

    from peer.optim.collaborative.optimizer import Optimizer

    if method.startswith("optimizer"):
        delayed = method == "optimizer+delay"
        return Optimizer(
            node=node,
            run_id=run,
            params=model.parameters(),
            **config.optimizer_options(),
            delay_grad_averaging=delayed,
            delay_optimizer_step=delayed,
        )
    from peer.optim.diloco.outer import DiLoCo

    streaming = method == "streaming"
    return DiLoCo(
        node=node,
        run_id=run,
        params=model.parameters(),
        inner_optimizer=config.make_optimizer(),
        inner_steps=cfg["inner_steps"],
        outer_optimizer=lambda p: torch.optim.SGD(
            p, lr=cfg["outer_lr"], momentum=cfg["outer_momentum"], nesterov=True
        ),
        fragments=cfg["fragments"] if streaming else 1,
        compression=cfg["compression"] if streaming else "none",
        overlap=streaming,
        batch_size_per_step=config.batch_size,
        matchmaking_time=config.matchmaking_time,
        averaging_timeout=config.averaging_timeout,
    )


def worker(cfg: dict[str, Any]) -> None:
    import torch

    from peer import Node
    from peer.formats.identity import OpenAuth
    from peer.tasks.base import TrainingConfig
    from peer.tasks.charlm import CharLMTask
    from swarmlab.node_process import wait_until

    torch.set_num_threads(1)
    rank, peers = cfg["rank"], cfg["peers"]
    node = Node(
        cfg["initial_peers"],
        auth=OpenAuth(),  # the benchmark's own namespaces: nobody else can reach them
        host=cfg["host"],
        port=PORT,
        bulk_port=PORT + 1,
        gossip_period=cfg["gossip_period"],
    )
    if not wait_until(lambda: len(node.members()) >= peers, 120, 0.05):
        raise SystemExit(f"peer {rank}: the other peers did not show up")
    task = CharLMTask()
    config = TrainingConfig.from_run_config(task, cfg["task_config"])

    def barrier(key: str, while_waiting: Any = None) -> None:
        node.store(key, True, node.get_time() + 600, subkey=node.peer_id)

        def everyone() -> bool:
            if while_waiting is not None:
                while_waiting()
            found = node.get(key, latest=True)
            return found is not None and len(found.value) >= peers

        if not wait_until(everyone, 300, 0.05):
            raise SystemExit(f"peer {rank}: the others did not reach {key}")

    for phase, method in enumerate(cfg["methods"]):
        result = _train(node, task, config, cfg, phase, method, barrier)
        print(json.dumps(result), flush=True)
    node.shutdown()


def _local_step_seconds(model: Any) -> float:
    """What an optimizer's own step costs on this model, here and now: the median of a few
    AdamW steps on a copy of its parameters (the work a step() call does besides waiting)."""
    import torch

    params = [torch.nn.Parameter(p.detach().clone()) for p in model.parameters()]
    for p in params:
        p.grad = torch.randn_like(p)
    opt = torch.optim.AdamW(params, lr=1e-3)
    seconds = []
    for _ in range(7):
        started = time.perf_counter()
        opt.step()
        seconds.append(time.perf_counter() - started)
    return statistics.median(seconds)


def _train(
    node: Any, task: Any, config: Any, cfg: dict[str, Any], phase: int, method: str, barrier: Any
) -> dict[str, Any]:
    """Train one method on this peer's share of the samples; what it measured."""
    import torch

    from peer.optim.utilisation import ComputeMeter

    rank, peers, batch = cfg["rank"], cfg["peers"], config.batch_size
    steps = cfg["samples"] // (peers * batch)  # each peer's share of the samples
    run = f"wan.{phase}"
    model = task.build_model(config)  # the same initialisation on every peer
    batches = task.train_batches(config, f"{rank}/{phase}")
    opt = _build(method, model, node, run, config, cfg)
    collaborative = method.startswith("optimizer")
    epochs = cfg["samples"] // config.target_batch_size
    snapshot_every = max(1, steps // cfg["snapshots"])
    snapshots: list[tuple[float, int, list[torch.Tensor]]] = []

    def snapshot(elapsed: float, samples: int) -> None:
        if rank == 0:  # peer 0's curve: copies now, evaluated once the method is done
            snapshots.append((elapsed, samples, [p.detach().clone() for p in model.parameters()]))

    meter, done = ComputeMeter(reference=_local_step_seconds(model)), 0
    barrier(f"{run}.ready")
    sent0 = node.bytes_sent
    started = time.perf_counter()
    snapshot(0.0, 0)
    while (opt.local_epoch < epochs) if collaborative else (done < steps):
        t0 = time.perf_counter()
        task.loss(model, next(batches)).backward()
        t1 = time.perf_counter()
        timed = None if collaborative else opt.inner_step_seconds
        opt.step()
        opt.zero_grad()
        t2 = time.perf_counter()
        # DiLoCo times its own inner step, under the same load as the rest of the call
        meter.add(t1 - t0, t2 - t1, None if timed is None else opt.inner_step_seconds - timed)
        done += 1
        if done % snapshot_every == 0:
            snapshot(t2 - started, done * batch * peers)
    wall = time.perf_counter() - started
    # the last rounds: with delays or overlap they are still in flight
    if collaborative:
        barrier(f"{run}.done", lambda: opt.step(batch_size=0))  # serve the others' rounds
        opt.wait_for_pending(timeout=300)
    else:
        opt.wait_for_pending(timeout=300)
        barrier(f"{run}.done")
    drained = time.perf_counter() - started
    sent = node.bytes_sent - sent0
    rounds = opt.local_epoch if collaborative else opt.outer_step
    # where a DiLoCo step() call's waiting went (see waits_line)
    waits = (
        {}
        if collaborative
        else dict(
            round_wait=opt.round_wait_seconds,
            catch_up=opt.catch_up_seconds,
            round_seconds=opt.round_seconds,
            straggler_wait=opt.straggler_wait_seconds,
            syncs=opt.rounds_done + opt.rounds_failed,
        )
    )
    snapshot(drained, done * batch * peers)
    opt.shutdown()
    barrier(f"{run}.left")
    curve = []
    for elapsed, samples, params in snapshots:  # off the clock
        with torch.no_grad():
            for p, saved in zip(model.parameters(), params, strict=True):
                p.copy_(saved)
        curve.append((elapsed, samples, task.evaluate(model, config)))
    return dict(
        method=method,
        samples=done * batch,
        seconds=wall,
        drained=drained,
        compute=meter.compute,
        waiting=meter.waiting,
        utilisation=meter.utilisation(),
        bytes_sent=sent,
        rounds=rounds,
        curve=curve,
        steps=done,
        median_call=statistics.median(meter.calls),
        median_local=statistics.median(
            [t for t in meter.local if t is not None] or [meter.local_step]
        ),
        reference=meter.reference,
        **waits,
    )


# ------------------------------------------------------------------------------ driver


def run_methods(lab: Any, args: argparse.Namespace, methods: list[str]) -> list[list[dict]]:
    """One worker per peer in its namespace; per method, the list of peers' results."""
    task_config = {
        "d_model": args.d_model,
        "n_layers": args.layers,
        "target_batch_size": args.target,
        "batch_size": args.batch,
        "matchmaking_time": args.matchmaking_time,
        "averaging_timeout": 60.0,
        "aggregator": "mean",  # every peer is ours: no robust aggregation needed
        "eval_windows": args.eval_windows,
    }
    configs = [
        dict(
            rank=rank,
            peers=args.peers,
            host=lab.address(rank),
            initial_peers=[] if rank == 0 else [f"ws://{lab.address(0)}:{PORT}"],
            gossip_period=args.gossip_period,
            task_config=task_config,
            samples=args.samples,
            methods=methods,
            inner_steps=args.inner_steps,
            fragments=args.fragments,
            compression=args.compression,
            outer_lr=args.outer_lr,
            outer_momentum=args.outer_momentum,
            snapshots=args.snapshots,
        )
        for rank in range(args.peers)
    ]
    from swarmlab.netlab import run_workers

    outputs = run_workers(lab, __file__, configs, args.timeout)
    return [[outputs[r][i] for r in range(args.peers)] for i in range(len(methods))]


def loss_at(curve: list[list[float]], x: float, axis: int) -> float:
    """The held-out loss of a curve of (seconds, samples, loss) points where coordinate
    ``axis`` (0: seconds, 1: samples) is ``x``, linearly interpolated (the last point's
    beyond the curve's end)."""
    for a, b in itertools.pairwise(curve):
        if a[axis] <= x <= b[axis]:
            span = b[axis] - a[axis]
            return a[2] if span == 0 else a[2] + (b[2] - a[2]) * (x - a[axis]) / span
    return curve[-1][2]


def summary(peers: list[dict[str, Any]]) -> dict[str, Any]:
    seconds = max(p["seconds"] for p in peers)
    samples = sum(p["samples"] for p in peers)
    curve = peers[0]["curve"]
    return dict(
        method=peers[0]["method"],
        samples_per_second=samples / seconds,
        utilisation=statistics.mean(p["utilisation"] for p in peers),
        waiting=statistics.mean(p["waiting"] for p in peers),
        compute=statistics.mean(p["compute"] for p in peers),
        bytes_per_sample=statistics.mean(p["bytes_sent"] / max(p["samples"], 1) for p in peers),
        rounds=peers[0]["rounds"],
        seconds=seconds,
        drained=max(p["drained"] for p in peers),
        curve=curve,
        waits={
            key: statistics.mean(p[key] for p in peers)
            for key in ("round_wait", "catch_up", "round_seconds", "straggler_wait", "syncs")
            if key in peers[0]
        },
        steps=statistics.mean(p["steps"] for p in peers),
        median_call=statistics.mean(p["median_call"] for p in peers),
        median_local=statistics.mean(p["median_local"] for p in peers),
        reference=statistics.mean(p["reference"] for p in peers),
    )


def waits_line(r: dict[str, Any], inner_steps: int, fragments: int) -> str | None:
    """Where a DiLoCo method's waiting went, per peer on average: blocked on the previous
    background round, loading the swarm's state, and the rest (each call's own overhead:
    progress reports, copies); beside how long its rounds took against the compute between
    two syncs, which a background round must fit in."""
    w = r["waits"]
    if not w:
        return None
    other = max(0.0, r["waiting"] - w["round_wait"] - w["catch_up"])
    syncs = max(1.0, w["syncs"])
    per_step = r["compute"] / max(1.0, r["steps"])  # forward/backward seconds per step
    between = per_step * inner_steps / max(1, fragments if r["method"] == "streaming" else 1)
    return (
        f"  {r['method']}: of {r['waiting']:.1f} s waiting, {w['round_wait']:.1f} s blocked on "
        f"the round in flight, {w['catch_up']:.1f} s loading state, {other:.1f} s in the calls "
        f"themselves (inline rounds, reports, copies); a round took {w['round_seconds'] / syncs:.2f} s "
        f"({w['straggler_wait'] / syncs:.2f} s of it waiting for slower peers) against "
        f"{between:.2f} s of forward/backward between two syncs; the median step() call "
        f"took {1e3 * r['median_call']:.1f} ms, its inner step {1e3 * r['median_local']:.1f} "
        f"ms (alone before training: {1e3 * r['reference']:.1f} ms)"
    )


def plot(results: list[dict[str, Any]], path: Path, title: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise SystemExit(
            "--plot needs matplotlib: pip install -e '.[dev]' (or --plot '' for no plot)"
        ) from None
    figure, (by_time, by_samples) = plt.subplots(1, 2, figsize=(11, 4.2))
    for r in results:
        seconds, samples, losses = zip(*r["curve"], strict=True)
        by_time.plot(seconds, losses, marker=".", label=r["method"])
        by_samples.plot(samples, losses, marker=".", label=r["method"])
    by_time.set_xlabel("wall time (s)")
    by_samples.set_xlabel("samples (swarm)")
    for axes in (by_time, by_samples):
        axes.set_ylabel("held-out loss (nats/byte)")
        axes.grid(alpha=0.3)
        axes.legend()
    figure.suptitle(title)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--peers", type=int, default=4)
    parser.add_argument("--rate", type=float, default=50.0, help="Mbit/s each way per link")
    parser.add_argument("--rtt", type=float, default=50.0, help="round trip between two peers, ms")
    parser.add_argument("--mix", type=int, help="a seed: a mix of home links instead")
    parser.add_argument("--samples", type=int, default=8192, help="samples per method, swarm")
    parser.add_argument("--batch", type=int, default=32, help="samples per forward/backward")
    parser.add_argument(
        "--target", type=int, default=128, help="the Optimizer's global batch (an epoch)"
    )
    parser.add_argument("--inner-steps", type=int, default=32, help="DiLoCo's H")
    parser.add_argument("--fragments", type=int, default=4, help="streaming DiLoCo's F")
    parser.add_argument("--compression", default="int8", help="streaming DiLoCo's codec")
    parser.add_argument("--outer-lr", type=float, default=0.7)
    parser.add_argument("--outer-momentum", type=float, default=0.9)
    parser.add_argument("--d-model", type=int, default=128)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument("--matchmaking-time", type=float, default=0.5)
    parser.add_argument("--gossip-period", type=float, default=1.0)
    parser.add_argument("--snapshots", type=int, default=10, help="evaluations per method")
    parser.add_argument("--eval-windows", type=int, default=128)
    parser.add_argument("--plot", default="wan.png", help="PNG to save ('' for none)")
    parser.add_argument("--check", action="store_true", help="exit 1 when a goal is missed")
    parser.add_argument("--timeout", type=float, default=1200.0)
    args = parser.parse_args()
    if args.worker:
        worker(json.loads(args.worker))
        return

    from swarmlab.netlab import NetLab, NetLabError, home_links, unavailable

    methods = [m for m in args.methods.split(",") if m]
    unknown = sorted(set(methods) - set(METHODS))
    if unknown or not methods:
        raise SystemExit(f"--methods takes some of {', '.join(METHODS)}; got {args.methods!r}")
    if args.peers < 2:
        raise SystemExit("--peers must be at least 2")
    per_round = args.peers * args.batch * args.inner_steps
    if args.samples < max(per_round, args.target) or args.samples % per_round:
        raise SystemExit(
            f"--samples must be a multiple of peers x batch x inner steps ({per_round}) and at "
            f"least --target ({args.target})"
        )
    if args.samples % args.target:
        raise SystemExit(f"--samples must be a multiple of --target ({args.target})")
    reason = unavailable()
    if reason is not None:
        raise SystemExit(f"bench/wan.py puts peers behind emulated links: {reason}")
    links = home_links(args.peers, seed=args.mix) if args.mix is not None else None
    where = (
        "home links " + ", ".join(f"{k.rate_mbit:g} Mbit/s {k.rtt_ms:g} ms" for k in links)
        if links is not None
        else f"{args.rate:g} Mbit/s each way and {args.rtt:g} ms round trips"
    )
    from peer.tasks.base import TrainingConfig
    from peer.tasks.charlm import CharLMTask

    task = CharLMTask()
    config = TrainingConfig.from_run_config(
        task, {"d_model": args.d_model, "n_layers": args.layers}
    )
    params = sum(p.numel() for p in task.build_model(config).parameters())
    print(
        f"wan: {args.peers} peers behind {where} (swarmlab.netlab); charlm transformer of "
        f"{params / 1e6:.2f}M parameters ({params * 4 / 1e6:.1f} MB fp32), {args.samples} "
        f"samples per method, batches of {args.batch}, one torch thread per peer, plain mean "
        "aggregation"
    )
    print(
        f"optimizer: global batch {args.target}; DiLoCo: H={args.inner_steps} inner AdamW "
        f"steps, outer Nesterov SGD lr {args.outer_lr:g} momentum {args.outer_momentum:g}; "
        f"streaming: {args.fragments} fragments, overlap, {args.compression}"
    )
    try:
        if links is not None:
            lab = NetLab(args.peers, links=links)
        else:
            lab = NetLab(args.peers, rate_mbit=args.rate, rtt_ms=args.rtt)
        with lab:
            started = time.perf_counter()
            results = [summary(peers) for peers in run_methods(lab, args, methods)]
            elapsed = time.perf_counter() - started
    except NetLabError as exc:
        raise SystemExit(f"could not set up the emulated links: {exc}") from None

    equal_time = min(r["seconds"] for r in results)
    for r in results:
        r["at_samples"] = loss_at(r["curve"], args.samples, 1)
        r["at_time"] = loss_at(r["curve"], equal_time, 0)
    print(
        f"\n  {'method':<16}{'compute util':>13}{'B/sample':>11}{'samples/s':>11}"
        f"{'rounds':>8}{'loss @samples':>15}{f'loss @{equal_time:.0f}s':>12}"
    )
    for r in results:
        print(
            f"  {r['method']:<16}{r['utilisation']:>13.1%}{r['bytes_per_sample']:>11.0f}"
            f"{r['samples_per_second']:>11.1f}{r['rounds']:>8}{r['at_samples']:>15.3f}"
            f"{r['at_time']:>12.3f}"
        )
    lines = [waits_line(r, args.inner_steps, args.fragments) for r in results]
    if any(lines):
        print("\nwhere DiLoCo waited (mean over the peers):")
        for line in lines:
            if line:
                print(line)
    by = {r["method"]: r for r in results}
    missed = []
    if "optimizer" in by:
        o = by["optimizer"]
        ratio = o["waiting"] / max(o["compute"], 1e-9)
        print(
            f"\nthe collaborative Optimizer waits {ratio:.2f}x as long on averaging as it "
            f"computes ({o['waiting'] / max(1, o['rounds']):.2f} s per epoch, "
            f"{o['compute'] / max(1, o['rounds']):.2f} s of compute): "
            + (
                "averaging takes at least as long as compute"
                if ratio >= 1
                else "averaging is shorter than compute: a slower link or a smaller --target "
                "makes the comparison the one this bench is for"
            )
        )
    if "streaming" in by:
        s = by["streaming"]
        goals = [
            (
                f"streaming DiLoCo compute utilisation {s['utilisation']:.1%} >= "
                f"{GOAL_UTILISATION:.0%}",
                s["utilisation"] >= GOAL_UTILISATION,
            )
        ]
        if "optimizer" in by:
            o = by["optimizer"]
            fewer = o["bytes_per_sample"] / max(s["bytes_per_sample"], 1e-9)
            loss = s["at_samples"] / o["at_samples"]
            goals += [
                (f"bytes/sample optimizer / streaming {fewer:.0f}x >= {GOAL_BYTES:.0f}x",
                 fewer >= GOAL_BYTES),
                (f"held-out loss at equal samples streaming / optimizer {loss:.3f} <= "
                 f"{GOAL_LOSS:.2f}", loss <= GOAL_LOSS),
            ]  # fmt: skip
        print()
        for text, met in goals:
            print(f"goal: {text}: {'met' if met else 'MISSED'}")
            if not met:
                missed.append(text)
    if args.plot:
        path = Path(args.plot)
        plot(results, path, f"charlm, {args.peers} peers behind {where}")
        print(f"plot: {path}")
    print(f"({elapsed:.0f} s in all)")
    if args.check and missed:
        raise SystemExit(f"missed: {'; '.join(missed)}")


if __name__ == "__main__":
    main()
