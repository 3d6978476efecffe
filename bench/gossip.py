"""Gossip convergence benchmark.

    python bench/gossip.py                 # 16 nodes as OS processes on loopback
    python bench/gossip.py --sim 500       # 500 in-memory nodes in simulated time
    python bench/gossip.py --sweep         # simulated sizes 16..500, to see the growth

Each node is bootstrapped from one random earlier node only. "Converged" means every node's
membership holds every node. Rounds are reported against log2(N) — push-pull anti-entropy
should need a small constant times log2(N) rounds — so the figure is comparable across
machines, unlike seconds.
"""

from __future__ import annotations

import argparse
import math
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from peer.testing import NodeProcess, wait_until
from swarmlab.sim import simulate


def processes(n: int, gossip_period: float) -> None:
    rng = random.Random(0)
    nodes: list[NodeProcess] = []
    try:
        for i in range(n):
            extra = ("--initial-peer", nodes[rng.randrange(i)].addresses[0]) if i else ()
            nodes.append(NodeProcess("--gossip-period", str(gossip_period), *extra))
        started = time.monotonic()
        ids = {node.peer_id for node in nodes}
        ok = wait_until(
            lambda: all(set(node.members()) == ids for node in nodes), 120, interval=0.05
        )
        elapsed = time.monotonic() - started
        rounds = [node.call(cmd="stats")["rounds"] for node in nodes]
        print(f"processes: {n} nodes, gossip period {gossip_period:.2f} s")
        print(f"  converged: {ok}  time after the last node started: {elapsed:.2f} s")
        print(
            f"  ≈ {elapsed / gossip_period:.1f} gossip periods; rounds run per node (median): {sorted(rounds)[n // 2]}"
        )
        print(f"  periods / log2(N) = {elapsed / gossip_period / math.log2(n):.2f}")
    finally:
        for node in nodes:
            node.quit()


def sim(n: int, seed: int) -> None:
    wall = time.monotonic()
    r = simulate(n, seed=seed)
    print(
        f"sim: {n:4d} nodes  converged={r.converged}  rounds={r.rounds:5.2f}  "
        f"simulated={r.simulated_seconds:5.2f} s  rounds/log2(N)={r.rounds / math.log2(n):4.2f}  "
        f"msgs/node/round={r.messages_per_node_per_round:5.1f}  "
        f"KiB/node/round={r.bytes_per_node_per_round / 1024:6.1f}  (wall {time.monotonic() - wall:.0f} s)"
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--sim", type=int, default=None, help="simulate this many in-memory nodes")
    parser.add_argument("--sweep", action="store_true", help="simulate 16, 32, ..., 500 nodes")
    parser.add_argument("--nodes", type=int, default=16, help="process count (default 16)")
    parser.add_argument("--gossip-period", type=float, default=0.25)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if args.sweep:
        for n in (16, 32, 64, 128, 256, 500):
            sim(n, args.seed)
    elif args.sim:
        sim(args.sim, args.seed)
    else:
        processes(args.nodes, args.gossip_period)


if __name__ == "__main__":
    main()
