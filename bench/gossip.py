"""Gossip convergence benchmark.

    python bench/gossip.py                        # 16 nodes as OS processes on loopback
    python bench/gossip.py --sim 50,100,250,500,1000  # cost per peer, converged swarms
    python bench/gossip.py --sweep                # convergence from cold, sizes 16..500

--sweep: each node is bootstrapped from one random earlier node only. "Converged" means
every node's membership holds every node. Rounds are reported against log2(N) — push-pull
anti-entropy should need a small constant times log2(N) rounds — so the figure is
comparable across machines, unlike seconds.

--sim N,N,...: a converged swarm of N real nodes in virtual time (swarmlab.gossip_cost):
messages and bytes each peer sends per second in steady gossip, its store, and how long
one new record takes to reach every node; then a least-squares fit of bytes per peer per
second against log2 N and against N, and the growth exponent (the slope of log bytes
against log N: 1 for linear growth, well under 1 for logarithmic).
"""

from __future__ import annotations

import argparse
import math
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from swarmlab.gossip_cost import GossipCost, steady_gossip
from swarmlab.node_process import NodeProcess, wait_until
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


def _fit(xs: list[float], ys: list[float]) -> tuple[float, float, float]:
    """Least squares y = a + b·x: (a, b, R²)."""
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sxx
    a = my - b * mx
    ss = sum((y - my) ** 2 for y in ys)
    res = sum((y - a - b * x) ** 2 for x, y in zip(xs, ys, strict=True))
    return a, b, 1.0 - res / ss if ss else 1.0


def cost_sweep(sizes: list[int], seed: int, window: float) -> None:
    print(
        f"{'N':>5} {'msgs/peer/s':>11} {'KiB/peer/s':>10} {'store recs':>10} {'store KiB':>9} "
        f"{'full share':>10} {'spread s':>8} {'spread/log2N':>12} {'wall s':>6}"
    )
    rows: list[GossipCost] = []
    for n in sizes:
        wall = time.monotonic()
        r = steady_gossip(n, window=window, seed=seed)
        rows.append(r)
        spread = "never" if r.spread_seconds is None else f"{r.spread_seconds:8.2f}"
        per_log = (
            "-"
            if r.spread_seconds is None
            else f"{r.spread_seconds / r.gossip_period / math.log2(n):12.2f}"
        )
        print(
            f"{n:>5} {r.messages_per_peer_s:>11.1f} {r.bytes_per_peer_s / 1024:>10.2f} "
            f"{r.store_records:>10.0f} {r.store_bytes / 1024:>9.0f} {r.full_share:>10.2f} "
            f"{spread:>8} {per_log:>12} {time.monotonic() - wall:>6.0f}",
            flush=True,
        )
    if len(rows) < 3:
        return
    ys = [r.bytes_per_peer_s / 1024 for r in rows]
    ns = [float(r.nodes) for r in rows]
    a_log, b_log, r2_log = _fit([math.log2(n) for n in ns], ys)
    a_lin, b_lin, r2_lin = _fit(ns, ys)
    _, exponent, _ = _fit([math.log(n) for n in ns], [math.log(y) for y in ys])
    print(f"fit KiB/peer/s = {a_log:.2f} + {b_log:.3f}·log2 N   R² = {r2_log:.3f}")
    print(f"fit KiB/peer/s = {a_lin:.2f} + {b_lin:.5f}·N        R² = {r2_lin:.3f}")
    print(
        f"growth exponent (slope of log bytes vs log N): {exponent:.2f}; "
        f"better fit: {'log N' if r2_log >= r2_lin else 'N'}; "
        f"N {rows[0].nodes} → {rows[-1].nodes}: bytes x{ys[-1] / ys[0]:.2f}, "
        f"log2 N x{math.log2(ns[-1]) / math.log2(ns[0]):.2f}, N x{ns[-1] / ns[0]:.0f}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--sim",
        default=None,
        help="comma-separated swarm sizes: steady gossip cost of converged swarms in virtual time",
    )
    parser.add_argument(
        "--window", type=float, default=20.0, help="virtual seconds measured (--sim)"
    )
    parser.add_argument(
        "--converge", type=int, default=None, help="one cold-start convergence run of N nodes"
    )
    parser.add_argument("--sweep", action="store_true", help="simulate 16, 32, ..., 500 nodes")
    parser.add_argument("--nodes", type=int, default=16, help="process count (default 16)")
    parser.add_argument("--gossip-period", type=float, default=0.25)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if args.sweep:
        for n in (16, 32, 64, 128, 256, 500):
            sim(n, args.seed)
    elif args.sim:
        try:
            sizes = [int(x) for x in args.sim.split(",")]
        except ValueError:
            parser.error("--sim takes comma-separated sizes, e.g. 50,100,250")
        if any(n < 2 for n in sizes):
            parser.error("--sim sizes must be at least 2")
        cost_sweep(sizes, args.seed, args.window)
    elif args.converge:
        sim(args.converge, args.seed)
    else:
        processes(args.nodes, args.gossip_period)


if __name__ == "__main__":
    main()
