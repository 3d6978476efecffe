"""``swarmgrad demo``: a handful of local peers that gossip, showing what each one sees.

Until the training job lands this is the main job: it starts ``peers`` nodes on loopback,
each bootstrapped from one other, has every node publish a progress record every second,
and prints a live table of each node's view of the swarm. Then it shuts everything down.
"""

from __future__ import annotations

import random
import time

from rich.console import Console
from rich.live import Live
from rich.table import Table

from peer.node import Node


def _table(nodes: list[Node], elapsed: float) -> Table:
    table = Table(title=f"Swarmgrad gossip demo — {elapsed:4.1f} s")
    table.add_column("peer")
    table.add_column("address")
    table.add_column("members seen", justify="right")
    table.add_column("progress records seen", justify="right")
    table.add_column("swarm samples (as this peer sees it)", justify="right")
    for node in nodes:
        progress = node.get("demo.progress")
        reports = progress.value if progress else {}
        samples = sum(int(r.value["samples"]) for r in reports.values())
        table.add_row(
            node.peer_id[:12],
            ", ".join(node.visible_addresses) or "(client mode)",
            f"{len(node.members())}/{len(nodes)}",
            str(len(reports)),
            f"{samples:,}",
        )
    return table


def run_demo(peers: int = 5, seconds: float = 12.0) -> None:
    if peers < 2:
        raise ValueError("the demo needs at least 2 peers")
    console = Console()
    rng = random.Random()
    nodes: list[Node] = []
    try:
        for i in range(peers):
            initial = nodes[rng.randrange(i)].visible_addresses if i else None
            # The last peer runs in client mode, as a volunteer behind NAT would.
            nodes.append(Node(initial, gossip_period=0.5, client_mode=(i == peers - 1)))
        console.print(
            f"started {peers} peers; the first listens on {nodes[0].visible_addresses[0]}"
        )
        samples = [0] * peers
        start = time.monotonic()
        with Live(_table(nodes, 0.0), console=console, refresh_per_second=4) as live:
            while (elapsed := time.monotonic() - start) < seconds:
                for i, node in enumerate(nodes):
                    samples[i] += rng.randint(32, 64)
                    node.store(
                        "demo.progress",
                        {"samples": samples[i], "time": node.get_time()},
                        node.get_time() + 10,
                        subkey=node.peer_id,
                    )
                live.update(_table(nodes, elapsed))
                time.sleep(1.0)
            live.update(_table(nodes, time.monotonic() - start))
        total = sum(samples)
        console.print(f"every peer reported; the swarm processed {total:,} samples in total")
    finally:
        for node in nodes:
            node.shutdown()
