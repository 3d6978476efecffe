"""Do the ``delay_*`` options hide averaging behind compute on a slow link?

    .venv/bin/python bench/overlap.py [--peers 2] [--rate 50] [--width 1024] [--repeat 3]

Runs ``--peers`` processes, each in its own network namespace whose link is shaped to
``--rate`` Mbit/s each way with tc's token bucket (:mod:`swarmlab.netlab`; needs root and
iproute2). Each trains an MLP (``--width`` hidden units, random data) with the collaborative
``peer.Optimizer`` and plain SGD with momentum, one torch thread per process:

1. calibration: a few epochs without delays measure the averaging time of an epoch (the
   gradient and state rounds, matchmaking included) and the compute time per sample; the
   ``target_batch_size`` is then chosen so that an epoch's compute takes about as long as its
   averaging — where hiding one behind the other can at best double the throughput;
2. ``--repeat`` times, in the same processes: ``--epochs`` epochs without delays, then as
   many with ``delay_grad_averaging`` and ``delay_optimizer_step`` (which bring
   ``offload_optimizer`` and ``delay_state_averaging``).

Per mode it prints the swarm's samples/s (every peer's samples over the slowest peer's
time), the fraction of the training loop's wall time spent inside ``step()`` (waiting on
averaging; accumulating the gradients is part of it and is cheap), bytes each peer's node
sent per sample, and seconds per epoch; then the ratio delayed / plain of samples/s per
repetition, as the median and the range. The first epoch of each mode (start-up, state
download) is not measured. ``--check`` exits with status 1 when the median ratio is below
``--min-ratio`` (1.5).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

PORT = 7700  # in every peer's own namespace: no clash with the machine's ports
INPUTS, CLASSES = 256, 10


# ------------------------------------------------------------------------------ worker


def worker(cfg: dict[str, Any]) -> None:
    import torch

    from peer import Node
    from peer.optim.collaborative.optimizer import Optimizer
    from swarmlab.node_process import wait_until

    torch.set_num_threads(1)
    rank, peers, batch = cfg["rank"], cfg["peers"], cfg["batch"]
    from peer.formats.identity import OpenAuth

    node = Node(
        cfg["initial_peers"],
        auth=OpenAuth(),  # the benchmark's own namespaces: nobody else can reach them
        host=cfg["host"],
        port=PORT,
        bulk_port=PORT + 1,
        gossip_period=0.2,
    )
    if not wait_until(lambda: len(node.members()) >= peers, 60, 0.05):
        raise SystemExit(f"peer {rank}: the other peers did not show up")
    torch.manual_seed(0)
    width = cfg["width"]
    model = torch.nn.Sequential(
        torch.nn.Linear(INPUTS, width),
        torch.nn.ReLU(),
        torch.nn.Linear(width, width),
        torch.nn.ReLU(),
        torch.nn.Linear(width, CLASSES),
    )
    g = torch.Generator().manual_seed(rank)
    pool = [
        (torch.randn(batch, INPUTS, generator=g), torch.randint(CLASSES, (batch,), generator=g))
        for _ in range(8)
    ]

    def barrier(key: str) -> None:
        node.store(key, True, node.get_time() + 600, subkey=node.peer_id)

        def everyone() -> bool:
            found = node.get(key, latest=True)
            return found is not None and len(found.value) >= peers

        if not wait_until(everyone, 120, 0.05):
            raise SystemExit(f"peer {rank}: the others did not reach {key}")

    for phase, (delayed, target, epochs) in enumerate(cfg["phases"]):
        run = f"overlap.{phase}"
        opt = Optimizer(
            node=node,
            run_id=run,
            target_batch_size=target,
            batch_size_per_step=batch,
            optimizer=lambda params: torch.optim.SGD(params, lr=0.01, momentum=0.9),
            params=model.parameters(),
            matchmaking_time=cfg["matchmaking_time"],
            averaging_timeout=120.0,
            delay_grad_averaging=delayed,
            delay_optimizer_step=delayed,
        )
        barrier(f"{run}.ready")
        samples, computing, waiting, started, sent = 0, 0.0, 0.0, 0.0, 0
        step = 0
        while opt.local_epoch < epochs + 1:
            t0 = time.perf_counter()
            x, y = pool[step % len(pool)]
            torch.nn.functional.cross_entropy(model(x), y).backward()
            t1 = time.perf_counter()
            opt.step()
            opt.zero_grad()
            t2 = time.perf_counter()
            step += 1
            if started:
                samples += batch
                computing += t1 - t0
                waiting += t2 - t1
            elif opt.local_epoch >= 1:  # the measured window starts with epoch 1
                started, sent = t2, node.bytes_sent
        seconds = time.perf_counter() - started
        sent = node.bytes_sent - sent
        # take part in the others' last rounds until everyone is done
        node.store(f"{run}.done", True, node.get_time() + 600, subkey=node.peer_id)

        def everyone_done(run: str = run, opt: Any = opt) -> bool:
            opt.step(batch_size=0)
            found = node.get(f"{run}.done", latest=True)
            return found is not None and len(found.value) >= peers

        wait_until(everyone_done, 120, 0.05)
        opt.wait_for_pending(timeout=120)
        opt.shutdown()
        barrier(f"{run}.left")
        result = dict(
            phase=phase,
            samples=samples,
            seconds=seconds,
            computing=computing,
            waiting=waiting,
            bytes_sent=sent,
            epochs=epochs,
        )
        print(json.dumps(result), flush=True)
    node.shutdown()


# ------------------------------------------------------------------------------ driver


def run_phases(lab: Any, args: argparse.Namespace, phases: list[tuple[bool, int, int]]) -> list:
    """Start one worker per peer in its namespace; per phase, the list of peers' results."""
    configs = [
        dict(
            rank=rank,
            peers=args.peers,
            batch=args.batch,
            width=args.width,
            host=lab.address(rank),
            initial_peers=[] if rank == 0 else [f"ws://{lab.address(0)}:{PORT}"],
            matchmaking_time=args.matchmaking_time,
            phases=phases,
        )
        for rank in range(args.peers)
    ]
    from swarmlab.netlab import run_workers

    outputs = run_workers(lab, __file__, configs, args.timeout)
    return [[outputs[r][i] for r in range(args.peers)] for i in range(len(phases))]


def summary(peers: list[dict[str, Any]]) -> dict[str, float]:
    seconds = max(p["seconds"] for p in peers)
    samples = sum(p["samples"] for p in peers)
    return dict(
        samples_per_second=samples / seconds,
        wait_fraction=statistics.mean(p["waiting"] / p["seconds"] for p in peers),
        bytes_per_sample=statistics.mean(p["bytes_sent"] / max(p["samples"], 1) for p in peers),
        seconds_per_epoch=seconds / peers[0]["epochs"],
        compute_per_sample=statistics.mean(p["computing"] / max(p["samples"], 1) for p in peers),
        wait_per_epoch=statistics.mean(p["waiting"] / p["epochs"] for p in peers),
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--peers", type=int, default=2)
    parser.add_argument("--rate", type=float, default=50.0, help="Mbit/s each way per link")
    parser.add_argument("--width", type=int, default=1024, help="hidden units of the MLP")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--epochs", type=int, default=5, help="measured epochs per mode")
    parser.add_argument("--repeat", type=int, default=3, help="plain/delayed pairs")
    parser.add_argument("--matchmaking-time", type=float, default=0.5)
    parser.add_argument("--target", type=int, help="target_batch_size (default: calibrated)")
    parser.add_argument("--check", action="store_true", help="exit 1 below --min-ratio")
    parser.add_argument("--min-ratio", type=float, default=1.5)
    parser.add_argument("--timeout", type=float, default=900.0)
    args = parser.parse_args()
    if args.worker:
        worker(json.loads(args.worker))
        return

    from swarmlab.netlab import NetLab, NetLabError, unavailable

    reason = unavailable()
    if reason is not None:
        raise SystemExit(f"bench/overlap.py shapes links in network namespaces: {reason}")
    if args.peers < 2 or args.epochs < 1 or args.repeat < 1:
        raise SystemExit("--peers must be at least 2, --epochs and --repeat at least 1")
    params = INPUTS * args.width + args.width * args.width + args.width * CLASSES
    params += 2 * args.width + CLASSES
    print(
        f"overlap: {args.peers} peers, each in its network namespace, links shaped to "
        f"{args.rate:g} Mbit/s each way (tc tbf); MLP of {params / 1e6:.2f}M parameters "
        f"({params * 4 / 1e6:.1f} MB fp32), batch {args.batch}, one torch thread per peer"
    )
    try:
        with NetLab(args.peers, rate_mbit=args.rate) as lab:
            target = args.target
            if target is None:
                probe = summary(run_phases(lab, args, [(False, args.peers * args.batch * 4, 3)])[0])
                per_peer = probe["wait_per_epoch"] / probe["compute_per_sample"]
                target = args.peers * args.batch * max(1, round(per_peer / args.batch))
                print(
                    f"calibration: averaging {probe['wait_per_epoch']:.2f} s per epoch, compute "
                    f"{1e3 * probe['compute_per_sample']:.2f} ms per sample -> target_batch_size "
                    f"{target} (an epoch's compute about as long as its averaging)"
                )
            phases = [
                (delayed, target, args.epochs)
                for _ in range(args.repeat)
                for delayed in (False, True)
            ]
            results = [summary(peers) for peers in run_phases(lab, args, phases)]
    except NetLabError as exc:
        raise SystemExit(f"could not set up the network namespaces: {exc}") from None

    print(f"  {'mode':<9}{'samples/s':>11}{'wait fraction':>15}{'B/sample':>10}{'s/epoch':>9}")
    ratios = []
    for i in range(0, len(results), 2):
        plain, delayed = results[i], results[i + 1]
        ratios.append(delayed["samples_per_second"] / plain["samples_per_second"])
        for name, r in (("plain", plain), ("delayed", delayed)):
            print(
                f"  {name:<9}{r['samples_per_second']:>11.1f}{r['wait_fraction']:>15.2f}"
                f"{r['bytes_per_sample']:>10.0f}{r['seconds_per_epoch']:>9.2f}"
            )
    median = statistics.median(ratios)
    print(
        f"delayed / plain samples/s: median {median:.2f}x, range {min(ratios):.2f}-"
        f"{max(ratios):.2f}x over {len(ratios)} repetitions (ideal 2x)"
    )
    if args.check and median < args.min_ratio:
        raise SystemExit(f"the delays gained {median:.2f}x, less than {args.min_ratio:g}x")


if __name__ == "__main__":
    main()
