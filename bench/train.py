"""Training benchmark on the built-in digits task: a swarm of DecentralizedSGD peers against
one process, on the same sample budget, measured in the same run.

    python bench/train.py                  # 4 peers, 30 epochs
    python bench/train.py --peers 2 --epochs 10

Every peer and the single reference run in their own OS process (spawned, one torch thread
each), so neither side shares an interpreter lock. Printed figures:

* test accuracy of the single process and of every peer (after the final round the peers
  hold the same model), and the gap in points;
* samples/s: the single process's, and the swarm's (all peers' samples over the longest
  peer's training time), and their ratio. The swarm pays for progress reports and background
  averaging; on a machine with fewer cores than peers the ratio says more about the scheduler
  than about Swarmgrad — compare ratios across changes on the same machine, not seconds.
"""

from __future__ import annotations

import argparse
import dataclasses
import multiprocessing
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
    parser.add_argument("--peers", type=int, default=4)
    parser.add_argument("--epochs", type=int, default=30)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--timeout", type=float, default=600.0)
    args = parser.parse_args(argv)
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


if __name__ == "__main__":
    sys.exit(main())
